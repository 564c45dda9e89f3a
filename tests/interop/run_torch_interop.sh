#!/usr/bin/env bash
# run_torch_interop.sh WORK_DIR VENV_DIR [PYTHON]: makes the Python side of
# the PyTorch interoperability test available, then runs check_torch.py on
# WORK_DIR's lenet.safetensors and reference.safetensors (export_lenet's).
#
# PYTHON (default /usr/bin/python3: Debian's, where python3-torch installs;
# a pyenv or conda python3 earlier on PATH lacks it) must import torch; the
# Debian packages python3-torch and python3-venv are installed when missing
# and this runs as root or with password-less sudo. safetensors is not packaged
# by Debian 12: it comes from PyPI into VENV_DIR, a venv that sees PYTHON's
# packages. Each step is skipped when its result is already there.
#
# Exit status: check_torch.py's (0 match, 1 mismatch), or 77 (CTest's skip)
# when the Python side cannot be installed; 2 for a wrong command line.
set -euo pipefail

SKIP=77
if (( $# < 2 || $# > 3 )); then
  echo "usage: $0 WORK_DIR VENV_DIR [PYTHON]" >&2
  exit 2
fi
work_dir="$1"
venv_dir="$2"
python="${3:-/usr/bin/python3}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

skip() {
  echo "skipped: $*" >&2
  exit "$SKIP"
}

imports() {
  "$1" -c "import $2" > /dev/null 2>&1
}

# Root, or sudo that will not stop to ask for a password (CTest has no terminal).
can_install() {
  (( EUID == 0 )) || { command -v sudo > /dev/null && sudo -n true 2> /dev/null; }
}

[[ -x "$python" ]] || skip "no Python interpreter at $python"

# Debian's python3 has the venv module without ensurepip until python3-venv is in.
if ! imports "$python" torch || ! imports "$python" ensurepip; then
  can_install || skip "$python cannot import torch (or ensurepip) and this user cannot install" \
    "python3-torch python3-venv (apt-get, as root)"
  # shellcheck source-path=SCRIPTDIR source=../../scripts/lib.sh
  source "$here/../../scripts/lib.sh"
  loom_install_packages python3-torch python3-venv ||
    skip "installing python3-torch python3-venv failed"
  imports "$python" torch ||
    skip "$python cannot import torch although python3-torch is installed; that package" \
      "serves Debian's /usr/bin/python3"
fi

if imports "$python" safetensors.torch; then
  runner="$python"
else
  runner="$venv_dir/bin/python"
  # A venv whose interpreter is gone (the system Python changed) is made again.
  if ! "$runner" -c "" 2> /dev/null; then
    echo "creating $venv_dir (sees $python's packages)"
    rm -rf "$venv_dir"
    "$python" -m venv --system-site-packages "$venv_dir" ||
      skip "'$python -m venv' failed; install python3-venv"
  fi
  if ! imports "$runner" safetensors.torch; then
    # Short timeouts: without a network the test should skip in seconds, not minutes.
    "$venv_dir/bin/pip" install --progress-bar off --timeout 30 --retries 1 safetensors ||
      skip "'pip install safetensors' into $venv_dir failed (no network or index?)"
    imports "$runner" safetensors.torch ||
      skip "$runner cannot import safetensors.torch after 'pip install safetensors'"
  fi
fi

exec "$runner" "$here/check_torch.py" "$work_dir/lenet.safetensors" \
  "$work_dir/reference.safetensors"
