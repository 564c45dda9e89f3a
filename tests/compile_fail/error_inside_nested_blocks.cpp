// A shape error two blocks deep is named by its path: the Conv2d is the 3rd
// layer of the Residual that is the 2nd layer of the Series at layer 2
// (LayerPath<2, 2, 3>), where a Flatten left it a flat vector.
#include <loom/loom.hpp>

using namespace loom;

#ifdef LOOM_COMPILE_FAIL
using Net = Sequential<Input<1, 8, 8>, Conv2d<4, 3, 1, 1>,
                       Series<ReLU, Residual<ReLU, Flatten, Conv2d<2, 3>>>, Flatten, Linear<10>>;
#else
using Net = Sequential<Input<1, 8, 8>, Conv2d<4, 3, 1, 1>,
                       Series<ReLU, Residual<ReLU, Conv2d<4, 3, 1, 1>>>, Flatten, Linear<10>>;
#endif

int main() { return Net::parameter_count > 0 ? 0 : 1; }
