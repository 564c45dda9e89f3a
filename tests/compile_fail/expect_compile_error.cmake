# Compiles SOURCE with LOOM_COMPILE_FAIL defined and passes only if the
# compiler rejects it with output matching EXPECT (a regular expression).
# Run as: cmake -DCOMPILER=... -DFLAGS=... -DSOURCE=... -DEXPECT=... -P this file
separate_arguments(flags UNIX_COMMAND "${FLAGS}")
execute_process(
  COMMAND "${COMPILER}" ${flags} -fsyntax-only -DLOOM_COMPILE_FAIL "${SOURCE}"
  RESULT_VARIABLE status
  OUTPUT_VARIABLE out
  ERROR_VARIABLE out)
if(status EQUAL 0)
  message(FATAL_ERROR "${SOURCE} compiled, but it must not")
endif()
if(NOT out MATCHES "${EXPECT}")
  message(FATAL_ERROR "${SOURCE} failed to compile, but without the expected message\n"
                      "expected (regex): ${EXPECT}\ncompiler said:\n${out}")
endif()
message(STATUS "rejected as expected: ${CMAKE_MATCH_0}")
