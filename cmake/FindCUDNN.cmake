# FindCUDNN: cuDNN 9's header and library as the imported target CUDNN::cudnn.
#
# Searches CUDNN_ROOT (variable or environment) first, then the CUDA toolkit.
# NVIDIA's Python wheels (nvidia.cudnn) ship only versioned sonames such as
# libcudnn.so.9 and no unversioned link, so those names are accepted too.
# Sets CUDNN_FOUND, CUDNN_VERSION, CUDNN_INCLUDE_DIR, CUDNN_LIBRARY.
include(FindPackageHandleStandardArgs)

set(_loom_cudnn_hints ${CUDNN_ROOT} $ENV{CUDNN_ROOT} ${CUDAToolkit_LIBRARY_ROOT}
    ${CUDAToolkit_TARGET_DIR} /usr/local/cuda)
find_path(CUDNN_INCLUDE_DIR cudnn_version.h
  HINTS ${_loom_cudnn_hints} ${CUDAToolkit_INCLUDE_DIRS}
  PATH_SUFFIXES include)
find_library(CUDNN_LIBRARY
  NAMES cudnn libcudnn.so.9 NAMES_PER_DIR
  HINTS ${_loom_cudnn_hints}
  PATH_SUFFIXES lib lib64 lib/x64)

if(CUDNN_INCLUDE_DIR AND EXISTS "${CUDNN_INCLUDE_DIR}/cudnn_version.h")
  file(STRINGS "${CUDNN_INCLUDE_DIR}/cudnn_version.h" _loom_cudnn_lines
       REGEX "^#define CUDNN_(MAJOR|MINOR|PATCHLEVEL) +[0-9]+")
  foreach(_part MAJOR MINOR PATCHLEVEL)
    string(REGEX REPLACE ".*#define CUDNN_${_part} +([0-9]+).*" "\\1" _loom_cudnn_${_part}
           "${_loom_cudnn_lines}")
  endforeach()
  set(CUDNN_VERSION "${_loom_cudnn_MAJOR}.${_loom_cudnn_MINOR}.${_loom_cudnn_PATCHLEVEL}")
endif()

find_package_handle_standard_args(CUDNN
  REQUIRED_VARS CUDNN_LIBRARY CUDNN_INCLUDE_DIR
  VERSION_VAR CUDNN_VERSION)

if(CUDNN_FOUND AND NOT TARGET CUDNN::cudnn)
  add_library(CUDNN::cudnn SHARED IMPORTED)
  set_target_properties(CUDNN::cudnn PROPERTIES
    IMPORTED_LOCATION "${CUDNN_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${CUDNN_INCLUDE_DIR}")
endif()
mark_as_advanced(CUDNN_INCLUDE_DIR CUDNN_LIBRARY)
