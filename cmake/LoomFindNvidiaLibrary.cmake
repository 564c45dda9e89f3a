# What FindCUDNN.cmake and FindNCCL.cmake share: find an NVIDIA library's
# header and shared library, read its version from #defines, report it, and
# make an imported target.
#
# loom_find_nvidia_library(<Name> HEADER <h> LIBRARY <name> SONAME <libx.so.N>
#                          VERSION_DEFINES <MAJOR> <MINOR> <PATCH> TARGET <ns::t>)
# Searches <Name>_ROOT (variable or environment) first, then the CUDA toolkit.
# NVIDIA's Python wheels ship only versioned sonames (libcudnn.so.9,
# libnccl.so.2) and no unversioned link, so SONAME is accepted too; with
# NAMES_PER_DIR the first folder that has either name wins.
# Sets <Name>_FOUND, <Name>_VERSION, <Name>_INCLUDE_DIR, <Name>_LIBRARY.
include(FindPackageHandleStandardArgs)

macro(loom_find_nvidia_library name)
  cmake_parse_arguments(_lfnl "" "HEADER;LIBRARY;SONAME;TARGET" "VERSION_DEFINES" ${ARGN})
  set(_lfnl_hints ${${name}_ROOT} $ENV{${name}_ROOT} ${CUDAToolkit_LIBRARY_ROOT}
      ${CUDAToolkit_TARGET_DIR} /usr/local/cuda)
  find_path(${name}_INCLUDE_DIR ${_lfnl_HEADER}
    HINTS ${_lfnl_hints} ${CUDAToolkit_INCLUDE_DIRS}
    PATH_SUFFIXES include)
  find_library(${name}_LIBRARY
    NAMES ${_lfnl_LIBRARY} ${_lfnl_SONAME} NAMES_PER_DIR
    HINTS ${_lfnl_hints}
    PATH_SUFFIXES lib lib64 lib/x64)

  if(${name}_INCLUDE_DIR AND EXISTS "${${name}_INCLUDE_DIR}/${_lfnl_HEADER}")
    file(STRINGS "${${name}_INCLUDE_DIR}/${_lfnl_HEADER}" _lfnl_lines
         REGEX "^#define [A-Z_]+ +[0-9]+")
    set(${name}_VERSION "")
    foreach(_lfnl_define IN ITEMS ${_lfnl_VERSION_DEFINES})
      string(REGEX REPLACE ".*#define ${_lfnl_define} +([0-9]+).*" "\\1" _lfnl_part
             "${_lfnl_lines}")
      list(APPEND ${name}_VERSION ${_lfnl_part})
    endforeach()
    list(JOIN ${name}_VERSION "." ${name}_VERSION)
  endif()

  find_package_handle_standard_args(${name}
    REQUIRED_VARS ${name}_LIBRARY ${name}_INCLUDE_DIR
    VERSION_VAR ${name}_VERSION)

  if(${name}_FOUND AND NOT TARGET ${_lfnl_TARGET})
    add_library(${_lfnl_TARGET} SHARED IMPORTED)
    set_target_properties(${_lfnl_TARGET} PROPERTIES
      IMPORTED_LOCATION "${${name}_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${${name}_INCLUDE_DIR}")
  endif()
  mark_as_advanced(${name}_INCLUDE_DIR ${name}_LIBRARY)
endmacro()
