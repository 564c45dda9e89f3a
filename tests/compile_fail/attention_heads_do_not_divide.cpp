// Attention whose 3 heads do not divide its width of 32: layer 4 is named.
#include <loom/loom.hpp>

using namespace loom;

#ifdef LOOM_COMPILE_FAIL
using Net = Sequential<Input<16>, Embedding<256, 32>, PositionEmbedding, LayerNorm,
                       CausalSelfAttention<3>>;
#else
using Net = Sequential<Input<16>, Embedding<256, 32>, PositionEmbedding, LayerNorm,
                       CausalSelfAttention<4>>;
#endif

int main() { return Net::parameter_count > 0 ? 0 : 1; }
