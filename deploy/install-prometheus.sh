#!/usr/bin/env bash
# Install Prometheus from the distribution, for tests/test_prometheus.py: a real Prometheus server that the
# test starts and stops itself (its own config, data dir and loopback port) to scrape `fate-rdma exporter`
# while a FATE launcher job runs. Nothing here starts or enables a system service.
#
#   deploy/install-prometheus.sh
#
# Idempotent. Without root or apt it says what to run and exits 0: the test then skips with that reason.
set -euo pipefail
. "$(dirname "$0")/apt-install.sh"

if command -v prometheus >/dev/null; then
  echo "install-prometheus: Prometheus already installed ($(prometheus --version 2>&1 | head -1))"
  exit 0
fi
apt_install install-prometheus tests/test_prometheus.py prometheus || exit 0
command -v prometheus >/dev/null || { echo "install-prometheus: installed, but there is no prometheus command" >&2; exit 1; }
echo "install-prometheus: $(prometheus --version 2>&1 | head -1)"
