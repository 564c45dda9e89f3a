// ModelSplit's At<...> cutting before a layer the network does not have
// (LeNet-like, 4 layers: cut indices 2 .. 4).
#include <loom/loom.hpp>
#include <loom/parallel/partition.hpp>

using namespace loom;

using Net = Sequential<Input<1, 8, 8>, Conv2d<4, 3>, ReLU, Flatten, Linear<10>>;

#ifdef LOOM_COMPILE_FAIL
using Cut = At<3, 7>;
#else
using Cut = At<3, 4>;
#endif

int main() { return partition_bounds<Net, Cut>::bounds[1] == 2 ? 0 : 1; }
