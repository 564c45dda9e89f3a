# One packaging check, run by CTest as `cmake -DLOOM_MODE=... -P` (arguments
# are set in tests/package/CMakeLists.txt):
#   install           install the parent build tree into LOOM_PREFIX
#   find_package      configure, build and run downstream/ against LOOM_PREFIX
#   add_subdirectory  the same with loom's source tree added as a subdirectory
# Each check starts from an empty folder so no earlier run can make it pass.
cmake_minimum_required(VERSION 3.25)

function(loom_run)
  execute_process(COMMAND ${ARGN} COMMAND_ECHO STDOUT RESULT_VARIABLE result)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "package test (${LOOM_MODE}): command failed (${result})")
  endif()
endfunction()

set(config_args "")
if(LOOM_CONFIG)
  set(config_args --config "${LOOM_CONFIG}")
endif()

if(LOOM_MODE STREQUAL "install")
  file(REMOVE_RECURSE "${LOOM_PREFIX}")
  loom_run("${CMAKE_COMMAND}" --install "${LOOM_PARENT_BUILD_DIR}"
           --prefix "${LOOM_PREFIX}" ${config_args})
  return()
endif()

if(LOOM_MODE STREQUAL "find_package")
  # Through the environment: a ';' list cannot survive execute_process's
  # argument lists, a ':' list in CMAKE_PREFIX_PATH's environment form can.
  string(REPLACE "|" ":" prefix_path "${LOOM_PREFIX_PATH}")
  set(ENV{CMAKE_PREFIX_PATH} "${prefix_path}")
  set(mode_args "")
elseif(LOOM_MODE STREQUAL "add_subdirectory")
  set(mode_args "-DLOOM_SOURCE_DIR=${LOOM_SOURCE_DIR}")
else()
  message(FATAL_ERROR "LOOM_MODE='${LOOM_MODE}': use install, find_package or add_subdirectory")
endif()

set(build_dir "${LOOM_WORK_DIR}/downstream-${LOOM_MODE}")
file(REMOVE_RECURSE "${build_dir}")
set(generator_args -G "${LOOM_GENERATOR}")
string(TOUPPER "${LOOM_CONFIG}" config_upper)
if(DEFINED LOOM_CXX_FLAGS_${config_upper})
  list(APPEND generator_args "-DCMAKE_CXX_FLAGS_${config_upper}=${LOOM_CXX_FLAGS_${config_upper}}")
endif()
if(LOOM_MAKE_PROGRAM)
  list(APPEND generator_args "-DCMAKE_MAKE_PROGRAM=${LOOM_MAKE_PROGRAM}")
endif()
loom_run("${CMAKE_COMMAND}" -S "${LOOM_DOWNSTREAM_DIR}" -B "${build_dir}"
         ${generator_args}
         "-DCMAKE_CXX_COMPILER=${LOOM_CXX_COMPILER}"
         "-DCMAKE_BUILD_TYPE=${LOOM_CONFIG}"
         "-DLOOM_DOWNSTREAM_VIA=${LOOM_MODE}"
         ${mode_args})
loom_run("${CMAKE_COMMAND}" --build "${build_dir}" ${config_args})
loom_run("${LOOM_CTEST}" --test-dir "${build_dir}" ${config_args}
         --output-on-failure --no-tests=error)
