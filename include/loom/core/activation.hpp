// The activations a GEMM or convolution epilogue can apply. Shared by layers
// (which pick one at compile time) and backends (which implement them).
#pragma once

namespace loom {

enum class Act { identity, relu };

}  // namespace loom
