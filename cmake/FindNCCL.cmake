# FindNCCL: NCCL's header and library as the imported target NCCL::nccl.
#
# Searches NCCL_ROOT (variable or environment) first, then the CUDA toolkit.
# NVIDIA's Python wheels (nvidia.nccl) ship only the versioned soname
# libnccl.so.2, so that name is accepted too.
# Sets NCCL_FOUND, NCCL_VERSION, NCCL_INCLUDE_DIR, NCCL_LIBRARY.
include(FindPackageHandleStandardArgs)

set(_loom_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_LIBRARY_ROOT}
    ${CUDAToolkit_TARGET_DIR} /usr/local/cuda)
find_path(NCCL_INCLUDE_DIR nccl.h
  HINTS ${_loom_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS}
  PATH_SUFFIXES include)
find_library(NCCL_LIBRARY
  NAMES nccl libnccl.so.2 NAMES_PER_DIR
  HINTS ${_loom_nccl_hints}
  PATH_SUFFIXES lib lib64)

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _loom_nccl_lines
       REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) +[0-9]+")
  foreach(_part MAJOR MINOR PATCH)
    string(REGEX REPLACE ".*#define NCCL_${_part} +([0-9]+).*" "\\1" _loom_nccl_${_part}
           "${_loom_nccl_lines}")
  endforeach()
  set(NCCL_VERSION "${_loom_nccl_MAJOR}.${_loom_nccl_MINOR}.${_loom_nccl_PATCH}")
endif()

find_package_handle_standard_args(NCCL
  REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR
  VERSION_VAR NCCL_VERSION)

if(NCCL_FOUND AND NOT TARGET NCCL::nccl)
  add_library(NCCL::nccl SHARED IMPORTED)
  set_target_properties(NCCL::nccl PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
