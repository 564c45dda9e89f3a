// A residual block whose body turns 10 x 16 into 10 x 32: no shortcut
// projects a sequence (layer 1).
#include <loom/loom.hpp>

using namespace loom;

#ifdef LOOM_COMPILE_FAIL
using Net = Sequential<Input<10, 16>, Residual<GRU<32, true>>, GRU<8>, Linear<2>>;
#else
using Net = Sequential<Input<10, 16>, Residual<GRU<16, true>>, GRU<8>, Linear<2>>;
#endif

int main() { return Net::parameter_count > 0 ? 0 : 1; }
