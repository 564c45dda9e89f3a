// A type that is not a loom layer in the layer list.
#include <loom/loom.hpp>

using namespace loom;

struct Dense {};

#ifdef LOOM_COMPILE_FAIL
using Net = Sequential<Input<4>, Dense, Linear<2>>;
#else
using Net = Sequential<Input<4>, ReLU, Linear<2>>;
#endif

int main() { return Net::parameter_count > 0 ? 0 : 1; }
