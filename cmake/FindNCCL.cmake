# FindNCCL: NCCL's header and library as the imported target NCCL::nccl.
# Honours NCCL_ROOT (e.g. the folder of the nvidia.nccl Python wheel) and the
# versioned soname libnccl.so.2. Sets NCCL_FOUND, NCCL_VERSION,
# NCCL_INCLUDE_DIR, NCCL_LIBRARY.
include("${CMAKE_CURRENT_LIST_DIR}/LoomFindNvidiaLibrary.cmake")
loom_find_nvidia_library(NCCL
  HEADER nccl.h LIBRARY nccl SONAME libnccl.so.2
  VERSION_DEFINES NCCL_MAJOR NCCL_MINOR NCCL_PATCH
  TARGET NCCL::nccl)
