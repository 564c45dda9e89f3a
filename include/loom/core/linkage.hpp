// Where loom's code that does not depend on a network type is compiled.
//
// By default loom is header-only: every translation unit compiles the parts
// it uses. With LOOM_SEPARATE_COMPILATION defined, the headers only declare
// the largest of those parts (checkpoint files, the fit loop, the grid
// engine, callbacks, agreement across ranks), and one translation unit of
// the program includes <loom/src.hpp>, which compiles them once, as Asio's
// separate compilation does. A program built this way compiles its network's
// code alone in each of its translation units (the examples: see
// examples/CMakeLists.txt).
//
// LOOM_DECL marks those functions: inline when header-only, an ordinary
// external function otherwise. LOOM_IMPLEMENT says whether this translation
// unit sees their definitions.
#pragma once

#if defined(LOOM_SEPARATE_COMPILATION)
#define LOOM_DECL
#if defined(LOOM_SOURCE)
#define LOOM_IMPLEMENT 1
#else
#define LOOM_IMPLEMENT 0
#endif
#else
#define LOOM_DECL inline
#define LOOM_IMPLEMENT 1
#endif
