#!/usr/bin/env bash
# System tools of the WAN testbed (`fate-rdma wan`, tests/test_wan.py) from the distribution:
#   iproute2 (ip, tc: namespaces, veths, tbf), nftables (random loss), gcc (the delay helper,
#   deploy/wan/delay_helper.c, compiled at `wan up`), iputils-ping (handy inside the sites).
#
#   deploy/wan/install-deps.sh
#
# Idempotent. Nothing is started or enabled: Debian's nftables.service would load /etc/nftables.conf
# (a `flush ruleset` of the host), so service starts are denied during the install. Without root or
# apt it says what to run and exits 0: the testbed then refuses with that reason and the test skips.
set -euo pipefail
. "$(dirname "$0")/../apt-install.sh"

need=()
command -v ip >/dev/null && command -v tc >/dev/null || need+=(iproute2)
command -v nft >/dev/null || need+=(nftables)
command -v cc >/dev/null || command -v gcc >/dev/null || need+=(gcc libc6-dev)
command -v ping >/dev/null || need+=(iputils-ping)
if [ ${#need[@]} -eq 0 ]; then
  echo "wan install-deps: ip, tc, nft, cc and ping present"
  exit 0
fi
apt_install "wan install-deps" tests/test_wan.py "${need[@]}" || true
exit 0
