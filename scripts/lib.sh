# shellcheck shell=bash
# Helpers shared by scripts/test, scripts/run and .ci/run. Source it; it
# defines functions and LOOM_ROOT and changes nothing else.

LOOM_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# Everything a build with tests, examples and benchmarks needs (DESIGN.md,
# "Dependencies"); the CUDA toolkit is not a Debian package and is not here.
# The Python packages serve the interop tests and scripts/plot_metrics.py
# (safetensors, which Debian 12 lacks, comes from PyPI into a venv; see
# tests/interop/run_torch_interop.sh).
# A one-node Slurm cluster for tests/dist/srun_cluster.sh (srun's mpi/pmix
# plugin, which Debian's Open MPI needs, is in slurm-client's dependency
# slurm-wlm-basic-plugins).
LOOM_SLURM_PACKAGES=(slurmctld slurmd slurm-client munge)
LOOM_DEBIAN_PACKAGES=(
  cmake ninja-build g++ clang libclang-rt-14-dev zlib1g-dev
  libopenblas-dev catch2 nlohmann-json3-dev libcli11-dev
  libopenmpi-dev openmpi-bin
  dataset-fashion-mnist fortunes
  python3-torch python3-matplotlib python3-venv
  espeak-ng libsndfile1-dev libkissfft-dev libsamplerate0-dev python3-torchaudio
  "${LOOM_SLURM_PACKAGES[@]}"
)

# loom_install_packages PACKAGE...: installs whichever of the Debian packages
# is missing; when none is, it touches neither the network nor apt's lists.
loom_install_packages() {
  local missing=() package
  for package in "$@"; do
    if [[ "$(dpkg-query -W -f='${Status}' "$package" 2>/dev/null || true)" != "install ok installed" ]]; then
      missing+=("$package")
    fi
  done
  if (( ${#missing[@]} == 0 )); then
    return 0
  fi
  local as_root=()
  if (( EUID != 0 )); then
    if ! command -v sudo > /dev/null; then
      echo "loom: missing packages ${missing[*]}; run this script as root or install them with apt-get" >&2
      return 1
    fi
    as_root=(sudo)
  fi
  echo "loom: installing ${missing[*]}" >&2
  "${as_root[@]}" apt-get update -q
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -q --no-install-recommends "${missing[@]}"
}

# Installs whichever of LOOM_DEBIAN_PACKAGES is missing.
loom_install_deps() {
  loom_install_packages "${LOOM_DEBIAN_PACKAGES[@]}"
}

# loom_tune_openblas: where OpenBLAS does not know this CPU's model it runs
# its Prescott (SSE3) kernels, whatever the CPU offers: Debian 12's 0.3.21
# does so on Intel's 5th-generation Xeon (family 6, model 207), where
# CPU training then takes 1.6 to 3 times as long. When OpenBLAS chose such
# a core on a CPU with AVX2 and FMA, this exports OPENBLAS_CORETYPE naming
# the best kernels the CPU's flags allow (OpenBLAS reads it when it loads)
# and says so on stderr. A user's OPENBLAS_CORETYPE is left as it is; so is
# everything where python3 cannot load libopenblas.so.0 to ask it.
loom_tune_openblas() {
  [[ -v OPENBLAS_CORETYPE ]] && return 0
  local flags chosen want="" core flag
  # No x86 flags line (aarch64, no /proc): nothing to tune.
  flags=" $(grep -m1 '^flags' /proc/cpuinfo 2> /dev/null | cut -d: -f2 || true) "
  # The first core whose flags the CPU has all of.
  for core in "Cooperlake:avx512f avx512bw avx512vl avx512dq avx512cd avx512_bf16" \
              "SkylakeX:avx512f avx512bw avx512vl avx512dq avx512cd" "Haswell:avx2 fma"; do
    want="${core%%:*}"
    for flag in ${core#*:}; do [[ "$flags" == *" $flag "* ]] || want=""; done
    [[ -n "$want" ]] && break
  done
  [[ -n "$want" ]] || return 0
  chosen="$(python3 -c 'import ctypes
blas = ctypes.CDLL("libopenblas.so.0")
blas.openblas_get_corename.restype = ctypes.c_char_p
print(blas.openblas_get_corename().decode())' 2> /dev/null)" || return 0
  case "$chosen" in
    Prescott | Core2 | Penryn | Dunnington | Nehalem | Atom | Sandybridge)
      export OPENBLAS_CORETYPE="$want"
      # The kernels replaced: tests/unit checks the C++ table
      # (cpu::better_blas_kernels) makes the same choice from them.
      export LOOM_OPENBLAS_REPLACED="$chosen"
      echo "loom: OpenBLAS chose its $chosen kernels on this CPU, which has $(
        [[ "$want" == Haswell ]] && echo AVX2 || echo AVX-512); OPENBLAS_CORETYPE=$want" \
        "for this run" >&2 ;;
  esac
}

# The build folder: LOOM_BUILD_DIR (relative to the repository root) or build/.
loom_build_dir() {
  local dir="${LOOM_BUILD_DIR:-build}"
  if [[ "$dir" != /* ]]; then
    dir="$LOOM_ROOT/$dir"
  fi
  printf '%s\n' "$dir"
}

# loom_configure_build BUILD_DIR [cmake args...]: configures everything
# (tests, examples, benchmarks) for Ninja in Release; later args win.
loom_configure_build() {
  local build_dir="$1"
  shift
  cmake -S "$LOOM_ROOT" -B "$build_dir" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DLOOM_BUILD_TESTS=ON \
    -DLOOM_BUILD_EXAMPLES=ON \
    -DLOOM_BUILD_BENCHMARKS=ON \
    "$@"
}

# loom_build BUILD_DIR [target...]: builds the targets (default: all) with
# every core, or LOOM_JOBS jobs.
loom_build() {
  local build_dir="$1"
  shift
  local targets=()
  if (( $# > 0 )); then
    targets=(--target "$@")
  fi
  cmake --build "$build_dir" --parallel "${LOOM_JOBS:-$(nproc)}" "${targets[@]}"
}
