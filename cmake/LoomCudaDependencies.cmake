# What loom::cuda needs, found the same way in the build tree and, through
# loomConfig.cmake, in an installed tree (FindCUDNN/FindNCCL sit beside this file).
list(APPEND CMAKE_MODULE_PATH "${CMAKE_CURRENT_LIST_DIR}")
if(CMAKE_FIND_PACKAGE_NAME STREQUAL "loom")
  find_package(CUDAToolkit QUIET)
  find_package(CUDNN 9 QUIET)
  find_package(NCCL 2 QUIET)
else()
  find_package(CUDAToolkit REQUIRED)
  find_package(CUDNN 9 REQUIRED)
  find_package(NCCL 2 REQUIRED)
endif()
