// <loom/src.hpp> after another loom header: that header has already
// declared, without defining, what src.hpp is there to compile, so src.hpp
// refuses at once rather than leave the program to fail at link time.
#define LOOM_SEPARATE_COMPILATION
#ifdef LOOM_COMPILE_FAIL
#include <loom/io/safetensors.hpp>
#endif
#include <loom/src.hpp>

int main() { return 0; }
