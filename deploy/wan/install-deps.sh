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

need=()
command -v ip >/dev/null && command -v tc >/dev/null || need+=(iproute2)
command -v nft >/dev/null || need+=(nftables)
command -v cc >/dev/null || command -v gcc >/dev/null || need+=(gcc libc6-dev)
command -v ping >/dev/null || need+=(iputils-ping)
if [ ${#need[@]} -eq 0 ]; then
  echo "wan install-deps: ip, tc, nft, cc and ping present"
  exit 0
fi
if ! command -v apt-get >/dev/null || [ "$(id -u)" != 0 ]; then
  echo "wan install-deps: missing ${need[*]}; as root run: apt-get install ${need[*]}" >&2
  echo "  (tests/test_wan.py skips without them)" >&2
  exit 0
fi
echo "wan install-deps: installing ${need[*]} with apt-get (no service is started)"
export DEBIAN_FRONTEND=noninteractive
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
  trap 'rm -f "$policy"' EXIT
  printf '#!/bin/sh\nexit 101\n' > "$policy"
  chmod 755 "$policy"
fi
if ! { timeout 600 apt-get update -qq && timeout 600 apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; }; then
  echo "wan install-deps: apt-get could not install ${need[*]}; tests/test_wan.py will skip and say why" >&2
fi
exit 0
