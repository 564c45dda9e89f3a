// The loss listed as a layer: it is the Trainer's, and the error says so.
#include <loom/loom.hpp>

using namespace loom;

#ifdef LOOM_COMPILE_FAIL
using Net = Sequential<Input<1, 28, 28>, Flatten, Linear<10>, SoftmaxCrossEntropy>;
#else
using Net = Sequential<Input<1, 28, 28>, Flatten, Linear<10>>;
#endif

int main() { return Net::parameter_count > 0 ? 0 : 1; }
