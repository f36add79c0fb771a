# fate-rdma: `make demo` runs the main job, `make test` runs the whole suite. Both set up .venv first.
# `make test-fast` is the fast tier (sans-IO, units, the in-process soft provider); `make check` lints and
# type-checks. The venv holds the product (fate_rdma, easypyverbs) and the lab (fate_rdma_lab, ./lab).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed-dev

PYTEST := $(PY) -m pytest -q -rs -p no:cacheprovider

.PHONY: demo test test-fast check lab test-rdma venv rdma-core rabbitmq prometheus wan-deps bench-verbs doctor clean

$(PY):
	bash deploy/check-space.sh $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=23,<26"

# one environment for the demo and the tests: the product, the lab, their dev tools, and FATE 2.2 + FATE-LLM
# (pins in pyproject's `fate` extra) + FATE-Flow 2.2 (its dependencies in the `flow` extra; fate-flow
# and fate-client go in with --no-deps, see pyproject); the start-up hook lets FATE's party processes see fate-rdma
FLOW_PKGS := fate-flow==2.2.0 fate-client==2.2.0
$(STAMP): $(PY) pyproject.toml setup.py lab/pyproject.toml
	$(PIP) install -q -e '.[dev,fate,flow]' -e ./lab
	$(PIP) install -q --no-deps $(FLOW_PKGS)
	$(VENV)/bin/fate-rdma hook install
	touch $@

venv: $(STAMP)

# the lab (fate_rdma_lab: benches, WAN testbed, evaluation, LoRA sweep, VM runner, demo): part of the venv
lab: $(STAMP)

# system rdma-core + pyverbs, linked into the venv (the pyverbs provider's "no device" path is tested)
rdma-core: $(STAMP)
	bash deploy/install-rdma-core.sh $(VENV)

demo: venv
	$(VENV)/bin/fate-rdma demo

# RabbitMQ from the distribution (apt), for tests/test_rabbitmq.py: FATE's rabbitmq engine against a
# real node the test starts and stops itself; where it cannot be installed the test skips and says why
rabbitmq:
	bash deploy/install-rabbitmq.sh

# Prometheus from the distribution (apt), for tests/test_prometheus.py: a real server the test starts and stops
# itself to scrape `fate-rdma exporter`; where it cannot be installed the test skips and says why
prometheus:
	bash deploy/install-prometheus.sh

# iproute2, nftables and gcc for the WAN testbed (tests/test_wan.py, `fate-rdma wan`); without root or
# apt it prints what to install and the test skips with that reason
wan-deps:
	bash deploy/wan/install-deps.sh

# -rs: every skipped test prints its reason. The host suite, then the pyverbs legs on rxe0 (test-rdma)
test: venv rdma-core rabbitmq prometheus wan-deps
	$(PYTEST)
	$(MAKE) --no-print-directory test-rdma

# the fast tier: tests not marked `system` (no FATE job, no VM, no testbed, no child processes of note);
# conftest.py marks whole modules as system
test-fast: venv
	$(PYTEST) -m "not system"

# lint (ruff) and types (mypy: strict on fate_rdma/protocol, fate_rdma/channel, easypyverbs/api.py; mypy.ini)
check: venv
	$(PY) -m ruff check .
	$(PY) -m mypy

# the pyverbs legs on Soft-RoCE (rxe0) in one qemu VM boot (deploy/rdma-vm); prints how many ran
# there; skipped, with the reason printed, where qemu cannot run
test-rdma: venv rdma-core
	$(PY) deploy/rdma-vm/test-rdma.py

doctor: venv
	$(VENV)/bin/fate-rdma doctor

bench-verbs: venv
	$(VENV)/bin/fate-rdma bench verbs --quick

clean:
	rm -rf $(VENV) build *.egg-info
