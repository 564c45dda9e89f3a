// Tensor parallelism over a degree that does not divide what it splits:
// the attention's heads (2 heads over 4 ranks), a block MLP's hidden
// features (90 over 4) and the vocabulary (100 over 8). Each is a compile
// error naming the layer, its number and the degree, in that order.
#include <loom/loom.hpp>

using namespace loom;

using Heads = Sequential<Input<16>, Embedding<256, 32>, LayerNorm, CausalSelfAttention<2>>;
using Mlp = Sequential<Input<16>, Embedding<256, 32>,
                       Residual<LayerNorm, Linear<90>, GELU, Linear<32>>, LayerNorm, Linear<256>>;
using Vocabulary = Sequential<Input<16>, Embedding<256, 32>, LayerNorm, Linear<100>>;

#ifdef LOOM_COMPILE_FAIL
constexpr std::size_t heads_degree = 4, mlp_degree = 4, vocabulary_degree = 8;
#else
constexpr std::size_t heads_degree = 2, mlp_degree = 2, vocabulary_degree = 4;
#endif

int main() {
  return tensor_shard_t<Heads, heads_degree>::parameter_count > 0 &&
                 tensor_shard_t<Mlp, mlp_degree>::parameter_count > 0 &&
                 tensor_shard_t<Vocabulary, vocabulary_degree>::parameter_count > 0
             ? 0
             : 1;
}
