// LeNet with a third 5x5 convolution: after the second pooling the maps are
// 4x4, so layer 7 cannot fit its window.
#include <loom/loom.hpp>

using namespace loom;

#ifdef LOOM_COMPILE_FAIL
using Net = Sequential<Input<1, 28, 28>, Conv2d<20, 5>, ReLU, MaxPool2d<2>, Conv2d<50, 5>, ReLU,
                       MaxPool2d<2>, Conv2d<10, 5>, Flatten, Linear<10>>;
#else
using Net = Sequential<Input<1, 28, 28>, Conv2d<20, 5>, ReLU, MaxPool2d<2>, Conv2d<50, 5>, ReLU,
                       MaxPool2d<2>, Conv2d<10, 3>, Flatten, Linear<10>>;
#endif

int main() { return Net::parameter_count > 0 ? 0 : 1; }
