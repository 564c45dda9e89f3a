// Linear after a convolution without Flatten: layer 3 gets a 3-D input.
#include <loom/loom.hpp>

using namespace loom;

#ifdef LOOM_COMPILE_FAIL
using Net = Sequential<Input<1, 28, 28>, Conv2d<20, 5>, ReLU, Linear<10>>;
#else
using Net = Sequential<Input<1, 28, 28>, Conv2d<20, 5>, ReLU, Flatten, Linear<10>>;
#endif

int main() { return Net::parameter_count > 0 ? 0 : 1; }
