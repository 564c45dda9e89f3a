// The one translation unit that holds Catch2's runner.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
