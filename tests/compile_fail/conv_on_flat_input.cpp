// A convolution over a flat vector input (layer 1 needs C x H x W).
#include <loom/loom.hpp>

using namespace loom;

#ifdef LOOM_COMPILE_FAIL
using Net = Sequential<Input<784>, Conv2d<4, 3>, Flatten, Linear<10>>;
#else
using Net = Sequential<Input<1, 28, 28>, Conv2d<4, 3>, Flatten, Linear<10>>;
#endif

int main() { return Net::parameter_count > 0 ? 0 : 1; }
