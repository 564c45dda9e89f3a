// A convolution with stride 0 (layer 1).
#include <loom/loom.hpp>

using namespace loom;

#ifdef LOOM_COMPILE_FAIL
using Net = Sequential<Input<1, 8, 8>, Conv2d<4, 3, 0>, Flatten, Linear<10>>;
#else
using Net = Sequential<Input<1, 8, 8>, Conv2d<4, 3, 1>, Flatten, Linear<10>>;
#endif

int main() { return Net::parameter_count > 0 ? 0 : 1; }
