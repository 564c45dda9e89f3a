// The translation unit that compiles what LOOM_SEPARATE_COMPILATION's
// headers only declare.
#include <loom/src.hpp>
