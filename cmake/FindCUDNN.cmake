# FindCUDNN: cuDNN 9's header and library as the imported target CUDNN::cudnn.
# Honours CUDNN_ROOT (e.g. the folder of the nvidia.cudnn Python wheel) and
# the versioned soname libcudnn.so.9. Sets CUDNN_FOUND, CUDNN_VERSION,
# CUDNN_INCLUDE_DIR, CUDNN_LIBRARY.
include("${CMAKE_CURRENT_LIST_DIR}/LoomFindNvidiaLibrary.cmake")
loom_find_nvidia_library(CUDNN
  HEADER cudnn_version.h LIBRARY cudnn SONAME libcudnn.so.9
  VERSION_DEFINES CUDNN_MAJOR CUDNN_MINOR CUDNN_PATCHLEVEL
  TARGET CUDNN::cudnn)
