# Install rules: headers, the loom::loom target and a relocatable CMake
# package, so that downstream code does find_package(loom) and links the same
# loom::loom it would get from add_subdirectory.
include(CMakePackageConfigHelpers)

# As a subproject loom installs nothing unless asked: the parent owns `install`.
option(LOOM_INSTALL "Generate loom's install rules" ${LOOM_TOP_LEVEL})
if(NOT LOOM_INSTALL)
  return()
endif()

set(LOOM_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/loom" CACHE STRING
    "Where loomConfig.cmake goes, relative to the install prefix")

install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/"
        DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")

install(TARGETS loom EXPORT loomTargets)
if(TARGET loom_cuda)
  install(TARGETS loom_cuda EXPORT loomTargets)
  install(FILES
            "${PROJECT_SOURCE_DIR}/cmake/LoomCudaDependencies.cmake"
            "${PROJECT_SOURCE_DIR}/cmake/FindCUDNN.cmake"
            "${PROJECT_SOURCE_DIR}/cmake/FindNCCL.cmake"
            "${PROJECT_SOURCE_DIR}/cmake/LoomFindNvidiaLibrary.cmake"
          DESTINATION "${LOOM_INSTALL_CMAKEDIR}")
endif()
if(TARGET loom_mpi)
  install(TARGETS loom_mpi EXPORT loomTargets)
endif()
set(LOOM_WITH_CUDA ${LOOM_ENABLE_CUDA})
set(LOOM_WITH_MPI ${LOOM_ENABLE_MPI})
install(EXPORT loomTargets
        NAMESPACE loom::
        DESTINATION "${LOOM_INSTALL_CMAKEDIR}")

configure_package_config_file(
  "${PROJECT_SOURCE_DIR}/cmake/loomConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/loomConfig.cmake"
  INSTALL_DESTINATION "${LOOM_INSTALL_CMAKEDIR}")

# 0.x promises no compatibility across minor versions, so 0.1 must not satisfy
# a request for 0.2 (SameMajorVersion would let it). ARCH_INDEPENDENT because
# the package is headers only: its libraries are found again by the consumer.
write_basic_package_version_file(
  "${PROJECT_BINARY_DIR}/loomConfigVersion.cmake"
  VERSION "${PROJECT_VERSION}"
  COMPATIBILITY SameMinorVersion
  ARCH_INDEPENDENT)

install(FILES
          "${PROJECT_BINARY_DIR}/loomConfig.cmake"
          "${PROJECT_BINARY_DIR}/loomConfigVersion.cmake"
          "${PROJECT_SOURCE_DIR}/cmake/LoomDependencies.cmake"
        DESTINATION "${LOOM_INSTALL_CMAKEDIR}")
