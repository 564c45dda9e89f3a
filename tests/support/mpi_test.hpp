// What the MPI test programs share: the process's dist::Environment (made
// before Catch runs, so MPI may take its arguments first) and their main.
// Include from exactly one file of each program, after catch.hpp with
// CATCH_CONFIG_RUNNER.
#pragma once

#include <cstdio>
#include <loom/loom.hpp>

namespace loom::test {
inline dist::Environment* environment = nullptr;
}  // namespace loom::test

int main(int argc, char** argv) {
  try {
    loom::dist::Environment env(argc, argv);
    loom::test::environment = &env;
    return Catch::Session().run(argc, argv);
  } catch (const loom::Error& error) {
    std::fprintf(stderr, "%s\n", error.what());
    return 1;
  }
}
