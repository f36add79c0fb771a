#!/usr/bin/env bash
# Install RabbitMQ from the distribution, for the test of FATE's rabbitmq federation engine
# (tests/test_rabbitmq.py). The test starts its own node (own data dir, ports, node name, epmd) as a
# child process and stops it; nothing here starts or enables a system service.
#
#   deploy/install-rabbitmq.sh
#
# FATE's rabbitmq federation also drives RabbitMQ's management HTTP API: the rabbitmq_management
# plugin ships in Debian's rabbitmq-server package and the test enables it for its own node only
# (its own enabled_plugins file). Idempotent. Without root or apt it says what to run and exits 0:
# the test then skips with that reason printed.
set -euo pipefail

server=/usr/lib/rabbitmq/bin/rabbitmq-server
have_rabbitmq() { [ -x "$server" ] && [ -n "$(ls -d /usr/lib/rabbitmq/lib/rabbitmq_server-*/plugins/rabbitmq_management-* 2>/dev/null)" ]; }

if have_rabbitmq; then
  echo "install-rabbitmq: RabbitMQ already installed ($(ls -d /usr/lib/rabbitmq/lib/rabbitmq_server-* | sed 's/.*rabbitmq_server-//'))"
  exit 0
fi
if ! command -v apt-get >/dev/null || [ "$(id -u)" != 0 ]; then
  echo "install-rabbitmq: RabbitMQ is missing; as root run: apt-get install rabbitmq-server" >&2
  echo "  (tests/test_rabbitmq.py skips without it)" >&2
  exit 0
fi

echo "install-rabbitmq: installing rabbitmq-server with apt-get (no service is started)"
export DEBIAN_FRONTEND=noninteractive
# keep the package's maintainer scripts from starting a system-wide node: a policy-rc.d that denies
# service starts, only for this install and only where the machine has none of its own
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
  trap 'rm -f "$policy"' EXIT
  printf '#!/bin/sh\nexit 101\n' > "$policy"
  chmod 755 "$policy"
fi
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends rabbitmq-server >/dev/null; }; then
  echo "install-rabbitmq: apt-get could not install rabbitmq-server (no network or no Debian mirror?);" >&2
  echo "  tests/test_rabbitmq.py will skip and say so" >&2
  exit 0
fi
have_rabbitmq || { echo "install-rabbitmq: installed, but $server or the management plugin is missing" >&2; exit 1; }
echo "install-rabbitmq: RabbitMQ $(ls -d /usr/lib/rabbitmq/lib/rabbitmq_server-* | sed 's/.*rabbitmq_server-//') installed"
