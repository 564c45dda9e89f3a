# shellcheck shell=bash
# Helpers shared by scripts/test, scripts/run and .ci/run. Source it; it
# defines functions and LOOM_ROOT and changes nothing else.

LOOM_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# Everything a build with tests, examples and benchmarks needs (DESIGN.md,
# "Dependencies"); the CUDA toolkit is not a Debian package and is not here.
# The Python packages serve the interop tests and scripts/plot_metrics.py
# (safetensors, which Debian 12 lacks, comes from PyPI into a venv; see
# tests/interop/run_torch_interop.sh).
LOOM_DEBIAN_PACKAGES=(
  cmake ninja-build g++ clang libclang-rt-14-dev zlib1g-dev
  libopenblas-dev catch2 nlohmann-json3-dev libcli11-dev
  libopenmpi-dev openmpi-bin
  dataset-fashion-mnist
  python3-torch python3-matplotlib python3-venv
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
