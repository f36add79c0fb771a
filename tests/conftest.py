"""Shared fixtures: every test ends with no easypyverbs object open and no soft-provider thread alive.

Tiers: `make test` runs everything; `make test-fast` leaves out the tests marked `system`: every test of
the modules in SYSTEM_MODULES (real FATE jobs, FATE-Flow, RabbitMQ, child processes, the WAN testbed,
the VM runner, pip installs) and single tests marked `@pytest.mark.system` in the other modules."""
from __future__ import annotations

import threading
import time
from typing import Optional

import pytest

import easypyverbs as ev


SYSTEM_MODULES = {
    "test_adversary", "test_bench_fate", "test_bench_latency", "test_bench_transfer", "test_cli_signals",
    "test_fate_flow", "test_fate_flow_osx", "test_fate_lr", "test_federation", "test_full_size", "test_holds",
    "test_hugepages", "test_launcher", "test_llm_fedavg", "test_product_install", "test_rabbitmq",
    "test_rdma_vm", "test_same_host", "test_soft_shm", "test_sweep", "test_timeline", "test_verbs_processes",
    "test_wan", "test_flood", "test_prometheus", "test_site_check", "test_site_check_wan", "test_site_init",
    "test_three_sites", "test_three_sites_mq", "test_resume_wan",
}


def pytest_ignore_collect(collection_path, config: pytest.Config) -> Optional[bool]:
    """Under `-m "not system"` (make test-fast) the system modules are not even imported: several import
    FATE, FATE-LLM or torch at collection, which alone would cost the fast tier seconds."""
    if config.getoption("markexpr", "") == "not system" and collection_path.stem in SYSTEM_MODULES:
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    for item in items:
        if item.module is not None and item.module.__name__.rpartition(".")[2] in SYSTEM_MODULES:
            item.add_marker(pytest.mark.system)


def soft_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("soft-") and t.is_alive()]


@pytest.fixture(autouse=True)
def no_leaks():
    yield
    left = ev.live_resources()
    for r in left:
        r.close()
    assert not left, f"test leaked open verbs objects: {left}"
    deadline = time.monotonic() + 5
    while soft_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not soft_threads(), f"test leaked soft-provider threads: {soft_threads()}"


def require_same_host() -> None:
    """Skip, naming why, a test of the soft provider's same-host path where an endpoint would not take it
    (switched off by EASYPYVERBS_SOFT_SAME_HOST, or process_vm_readv refused): it would run over TCP instead."""
    from easypyverbs.providers.soft import samehost

    ok, why = samehost.available()
    if not ok:
        pytest.skip(f"the soft provider's same-host path is not available here: {why}")
