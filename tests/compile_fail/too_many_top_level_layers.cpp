// A network of 64 layers at its top level: a block's layers are numbered
// 64 x its index + 1, 2, ..., so the top level stops at 63 (group layers
// into blocks).
#include <loom/loom.hpp>

using namespace loom;

// clang-format off
#ifdef LOOM_COMPILE_FAIL
using Net = Sequential<Input<4>, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, Linear<2>>;
#else
using Net = Sequential<Input<4>, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, ReLU, Linear<2>>;
#endif
// clang-format on

int main() { return Net::parameter_count > 0 ? 0 : 1; }
