// The examples' share of loom that no network type changes (checkpoint
// files, the fit loop, the grid engine, callbacks), compiled once for all of
// them: they are built with LOOM_SEPARATE_COMPILATION (core/linkage.hpp).
#include <loom/src.hpp>
