#!/usr/bin/env bash
# Install the system's rdma-core and pyverbs, and make pyverbs importable inside a venv.
#
#   deploy/install-rdma-core.sh [VENV]      (default VENV: .venv)
#
# pyverbs is not installed from PyPI: it must match the system's libibverbs, so it comes from the
# distribution (Debian/Ubuntu: rdma-core, ibverbs-providers, python3-pyverbs; RHEL/Fedora:
# `dnf install rdma-core python3-pyverbs`). The distribution builds it for its own python3; the venv
# then sees it through a .pth file naming a folder that holds a link to the system's pyverbs package.
# Idempotent. Without root or apt it explains what to run and leaves the venv unchanged.
set -euo pipefail

venv=${1:-.venv}
sys_py=/usr/bin/python3
have_pyverbs() { [ -x "$sys_py" ] && "$sys_py" -c 'import pyverbs.device' 2>/dev/null; }

if ! have_pyverbs; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "install-rdma-core: installing rdma-core, ibverbs-providers, python3-pyverbs with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends rdma-core ibverbs-providers python3-pyverbs >/dev/null
  elif command -v dnf >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "install-rdma-core: installing rdma-core, python3-pyverbs with dnf"
    dnf install -y -q rdma-core libibverbs python3-pyverbs
  else
    echo "install-rdma-core: pyverbs is missing; as root run: apt-get install rdma-core ibverbs-providers python3-pyverbs" >&2
    echo "  (or dnf install rdma-core python3-pyverbs). The soft provider works without it." >&2
    exit 0
  fi
fi
have_pyverbs || { echo "install-rdma-core: pyverbs still not importable by $sys_py" >&2; exit 1; }

pkg_dir=$("$sys_py" -c 'import os, pyverbs; print(os.path.dirname(pyverbs.__file__))')
sys_ver=$("$sys_py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
echo "install-rdma-core: system pyverbs at $pkg_dir (built for Python $sys_ver)"

if [ ! -x "$venv/bin/python" ]; then
  echo "install-rdma-core: no venv at $venv; nothing to link"
  exit 0
fi
venv_ver=$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$venv_ver" != "$sys_ver" ]; then
  echo "install-rdma-core: venv Python $venv_ver differs from the system's $sys_ver; pyverbs's extension modules" >&2
  echo "  cannot load there. Make the venv with Python $sys_ver to use the pyverbs provider." >&2
  exit 0
fi
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
link_dir=$(cd "$venv" && pwd)/system-pyverbs
mkdir -p "$link_dir"
ln -sfn "$pkg_dir" "$link_dir/pyverbs"
echo "$link_dir" > "$site/easypyverbs-system-pyverbs.pth"
if "$venv/bin/python" -c 'import pyverbs.device' 2>/dev/null; then
  echo "install-rdma-core: pyverbs importable in $venv"
else
  echo "install-rdma-core: linked, but pyverbs does not import in $venv" >&2
  exit 1
fi
