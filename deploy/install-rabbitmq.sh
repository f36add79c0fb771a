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
. "$(dirname "$0")/apt-install.sh"

server=/usr/lib/rabbitmq/bin/rabbitmq-server
have_rabbitmq() { [ -x "$server" ] && [ -n "$(ls -d /usr/lib/rabbitmq/lib/rabbitmq_server-*/plugins/rabbitmq_management-* 2>/dev/null)" ]; }

if have_rabbitmq; then
  echo "install-rabbitmq: RabbitMQ already installed ($(ls -d /usr/lib/rabbitmq/lib/rabbitmq_server-* | sed 's/.*rabbitmq_server-//'))"
  exit 0
fi
apt_install install-rabbitmq tests/test_rabbitmq.py rabbitmq-server || exit 0
have_rabbitmq || { echo "install-rabbitmq: installed, but $server or the management plugin is missing" >&2; exit 1; }
echo "install-rabbitmq: RabbitMQ $(ls -d /usr/lib/rabbitmq/lib/rabbitmq_server-* | sed 's/.*rabbitmq_server-//') installed"
