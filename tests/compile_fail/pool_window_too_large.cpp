// A 5x5 pooling window over 4x4 maps (layer 2).
#include <loom/loom.hpp>

using namespace loom;

#ifdef LOOM_COMPILE_FAIL
using Net = Sequential<Input<3, 6, 6>, Conv2d<8, 3>, MaxPool2d<5>, Flatten, Linear<2>>;
#else
using Net = Sequential<Input<3, 6, 6>, Conv2d<8, 3>, MaxPool2d<4>, Flatten, Linear<2>>;
#endif

int main() { return Net::parameter_count > 0 ? 0 : 1; }
