// Include in exactly one .cpp of a program built with
// LOOM_SEPARATE_COMPILATION (core/linkage.hpp), before any other loom
// header: it compiles the functions the headers only declare there. Compile
// it with the same definitions (LOOM_WITH_MPI, ...) as the rest of the
// program: the CMake target loom::loom and loom::mpi carry them.
#pragma once

#if !defined(LOOM_SEPARATE_COMPILATION)
#error "<loom/src.hpp> is for programs built with LOOM_SEPARATE_COMPILATION; without it loom is header-only and needs no source file"
#endif
#if defined(LOOM_DECL)
#error "<loom/src.hpp> must come before every other loom header in its translation unit"
#endif

#define LOOM_SOURCE
#include "loom.hpp"
