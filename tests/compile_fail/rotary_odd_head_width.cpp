// Rotary attention whose 8 heads leave each an odd width of 3 (24 / 8):
// rotary positions turn features in pairs, and layer 3 is named.
#include <loom/loom.hpp>

using namespace loom;

#ifdef LOOM_COMPILE_FAIL
using Net = Sequential<Input<16>, Embedding<256, 24>, LayerNorm, CausalSelfAttention<8, Rotary<>>>;
#else
using Net = Sequential<Input<16>, Embedding<256, 24>, LayerNorm, CausalSelfAttention<4, Rotary<>>>;
#endif
// Without rotary positions an odd head width is no error.
using Plain = Sequential<Input<16>, Embedding<256, 24>, LayerNorm, CausalSelfAttention<8>>;

int main() { return Net::parameter_count > 0 && Plain::parameter_count > 0 ? 0 : 1; }
