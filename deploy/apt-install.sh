# Sourced by the install scripts of deploy/ (rabbitmq, prometheus, the WAN testbed's tools):
#
#   apt_install WHO TEST PACKAGE...
#
# installs the packages with apt-get, quietly and without starting any service (a policy-rc.d that denies
# service starts, only for this install and only where the machine has none of its own). Without root or apt,
# or where apt-get fails (no Debian mirror), it says what to run and that TEST skips without them, and
# returns 1; the caller then exits 0, so that `make test` goes on and the test says why it skipped.
apt_install() {
  local who=$1 test=$2
  shift 2
  if ! command -v apt-get >/dev/null || [ "$(id -u)" != 0 ]; then
    echo "$who: missing $*; as root run: apt-get install $*" >&2
    echo "  ($test skips without it)" >&2
    return 1
  fi
  echo "$who: installing $* with apt-get (no service is started)"
  export DEBIAN_FRONTEND=noninteractive
  local policy=/usr/sbin/policy-rc.d made=0 failed=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod 755 "$policy"
    made=1
  fi
  { timeout 600 apt-get update -qq && timeout 600 apt-get install -y -qq --no-install-recommends "$@" >/dev/null; } \
    || failed=1
  if [ "$made" = 1 ]; then rm -f "$policy"; fi
  if [ "$failed" = 1 ]; then
    echo "$who: apt-get could not install $* (no network or no Debian mirror?); $test will skip and say so" >&2
    return 1
  fi
}
