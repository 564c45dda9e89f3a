# What loom::loom needs, found the same way in the build tree and, through
# loomConfig.cmake, in an installed tree.
include(CMakeFindDependencyMacro)
include(GNUInstallDirs)

# Inside find_package(loom) a missing dependency makes loom "not found";
# in loom's own build it is a hard error, reported where it happens.
macro(loom_find_dependency)
  if(CMAKE_FIND_PACKAGE_NAME STREQUAL "loom")
    find_dependency(${ARGN})
  else()
    find_package(${ARGN} REQUIRED)
  endif()
endmacro()

set(THREADS_PREFER_PTHREAD_FLAG ON)
loom_find_dependency(Threads)
loom_find_dependency(ZLIB)
loom_find_dependency(nlohmann_json 3.10)

# OpenBLAS for cblas_sgemm/cblas_dgemm; BLA_VENDOR keeps FindBLAS from picking
# the slow reference BLAS when both are installed.
if(NOT DEFINED BLA_VENDOR)
  set(BLA_VENDOR OpenBLAS)
endif()
loom_find_dependency(BLAS)
find_path(LOOM_CBLAS_INCLUDE_DIR cblas.h
  PATH_SUFFIXES openblas x86_64-linux-gnu aarch64-linux-gnu
  DOC "Folder holding OpenBLAS's cblas.h")
if(NOT LOOM_CBLAS_INCLUDE_DIR)
  message(FATAL_ERROR "loom: cblas.h not found; install OpenBLAS (Debian: apt-get install libopenblas-dev)")
endif()

# Audio (data/audio.hpp): libsndfile reads the audio files, KissFFT's real FFT
# computes log-mel features (Debian: libsndfile1-dev libkissfft-dev). Both
# come through pkg-config as one target, PkgConfig::LOOM_AUDIO, which an
# installed loom::loom names and this file makes again for the consumer.
loom_find_dependency(PkgConfig)
if(CMAKE_FIND_PACKAGE_NAME STREQUAL "loom")
  pkg_check_modules(LOOM_AUDIO QUIET IMPORTED_TARGET sndfile kissfft-float)
  if(NOT LOOM_AUDIO_FOUND)
    set(loom_FOUND FALSE)
    set(loom_NOT_FOUND_MESSAGE "loom needs libsndfile and KissFFT (pkg-config sndfile, "
        "kissfft-float); Debian: apt-get install libsndfile1-dev libkissfft-dev")
    return()
  endif()
else()
  pkg_check_modules(LOOM_AUDIO IMPORTED_TARGET sndfile kissfft-float)
  if(NOT LOOM_AUDIO_FOUND)
    message(FATAL_ERROR "loom: libsndfile or KissFFT not found through pkg-config (sndfile, "
                        "kissfft-float); install them (Debian: apt-get install libsndfile1-dev "
                        "libkissfft-dev)")
  endif()
endif()
