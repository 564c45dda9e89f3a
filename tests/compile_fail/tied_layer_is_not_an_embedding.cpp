// Weight tying to a layer that is not an Embedding of the head's shape:
// TiedLinear<256, 2> names layer 2, a PositionEmbedding, and TiedLinear<256,
// 9> a layer the network does not have. Each is a compile error naming the
// head, the layer it names and the numbers.
#include <loom/loom.hpp>

using namespace loom;

#ifdef LOOM_COMPILE_FAIL
constexpr std::size_t not_an_embedding = 2, missing = 9;
#else
constexpr std::size_t not_an_embedding = 1, missing = 1;
#endif

using WrongLayer = Sequential<Input<16>, Embedding<256, 32>, PositionEmbedding, LayerNorm,
                              TiedLinear<256, not_an_embedding>>;
using NoLayer = Sequential<Input<16>, Embedding<256, 32>, LayerNorm, TiedLinear<256, missing>>;

int main() { return WrongLayer::ties.size() == 1 && NoLayer::ties.size() == 1 ? 0 : 1; }
