"""Fair under pressure: each peer may hold at most its part of a receiving endpoint's memory budget
(peer_budget_fraction), so one party cannot take what the others need, and a refusal tells the peer its request,
never the budget or what is left of it. Unit tests of buffers.Budget and Share, then endpoints of this process on
the soft provider (an arbiter and two clients, payloads of a few MiB)."""
from __future__ import annotations

import logging
import os
import re

import crc32c
import pytest

from fate_rdma import errors as E
from fate_rdma.channel import Endpoint
from fate_rdma.channel.buffers import Budget, Share
from fate_rdma.config import ChannelConfig

MiB = 1 << 20
BUDGET = 8 * MiB


# -- the budget and a connection's share ---------------------------------------------------------------------
def test_one_peer_cannot_take_more_than_its_part_while_another_still_gets_its_own():
    budget = Budget(BUDGET, BUDGET // 2)
    a, a_again, b = Share(budget, "client-a"), Share(budget, "client-a"), Share(budget, "client-b")
    assert a.reserve(3 * MiB) and not a.reserve(2 * MiB)  # 5 MiB: over its half, though the budget has room
    assert not a_again.reserve(2 * MiB)  # a second connection of the same peer counts with the first
    assert a_again.reserve(MiB) and budget.held_by("client-a") == 4 * MiB
    assert b.reserve(4 * MiB)  # the other peer still gets its whole part
    assert budget.held_bytes == BUDGET and a.free_bytes == b.free_bytes == 0
    a.release_all()
    assert budget.held_by("client-a") == MiB and a.held_bytes == 0 and a_again.free_bytes == 3 * MiB
    assert b.free_bytes == 0  # its part is spent, whatever the budget has left
    a_again.release(MiB)
    b.release_all()
    assert budget.held_bytes == 0 and budget.held_by("client-a") == budget.held_by("client-b") == 0


@pytest.mark.parametrize("clients", [2, 3, 5, 8])
def test_an_arbiter_takes_every_clients_upload_that_fits_the_budget(clients):
    """peer_budget_fraction's default refuses no FedAvg job whose uploads fit the budget together."""
    cfg = ChannelConfig(memory_budget_bytes=BUDGET)
    budget = Budget(cfg.budget_bytes, cfg.peer_budget_bytes)
    upload = BUDGET // clients
    assert all(Share(budget, f"client-{i}").reserve(upload) for i in range(clients))


def test_the_receivers_log_explains_a_refusal_once_per_peer(caplog):
    caplog.set_level(logging.DEBUG, logger="fate_rdma.channel")
    budget = Budget(BUDGET, BUDGET // 2)
    for peer in ("client-a", "client-a", "client-a", "client-b"):
        assert not Share(budget, peer).reserve(5 * MiB)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2 and "client-a" in warned[0] and "client-b" in warned[1]
    assert f"of the {BUDGET // 2} bytes one peer may hold" in warned[0] and f"of {BUDGET}" in warned[0]


def test_peer_budget_fraction_is_checked():
    assert ChannelConfig(memory_budget_bytes=BUDGET).peer_budget_bytes == BUDGET // 2
    assert ChannelConfig(memory_budget_bytes=BUDGET, peer_budget_fraction=1).peer_budget_bytes == BUDGET
    for bad in (0, -0.5, 1.5, True, "half"):
        with pytest.raises(E.ConfigError, match="peer_budget_fraction must be within"):
            ChannelConfig(peer_budget_fraction=bad)


# -- an arbiter and two clients ------------------------------------------------------------------------------
def cfg(mode: str) -> ChannelConfig:
    """FedRDMA's staging (max_window x (64 KiB + header area): 0.75 MiB) leaves a peer room for a 3 MiB upload."""
    return ChannelConfig(mode=mode, provider="soft", memory_budget_bytes=BUDGET, chunk_bytes=64 << 10,
                         slot_initial_bytes=4096, slot_bytes=8 * MiB, window=4, max_window=4,
                         same_host_chunk_bytes=0, tcp_chunk_bytes=0, connect_timeout_s=10, no_progress_timeout_s=10)


def told(exc: BaseException) -> str:
    """What the receiver told the sender (the refusal's reason, after "refused by <peer>: ")."""
    return str(exc).split(": ", 1)[1]


def assert_discloses_no_budget(reason: str, *allowed: int) -> None:
    """`reason` names no figure but the request's own (`allowed`): not the budget, a peer's part, or what is held."""
    figures = {int(n) for n in re.findall(r"\d+", reason)}
    assert figures <= set(allowed), (reason, figures - set(allowed))
    assert "exceeds the receiver's limit for this peer" in reason and "budget" not in reason


@pytest.mark.parametrize("mode", ["fedrdma-e", "fedrdma"])
def test_arbiter_takes_two_uploads_at_once(mode):
    """The legit 3-party pattern: an arbiter holds both clients' uploads (3 MiB each, 6 of its 8 MiB) at once."""
    with Endpoint(cfg(mode), name="arbiter") as arbiter, Endpoint(cfg(mode), name="client-a") as a, \
            Endpoint(cfg(mode), name="client-b") as b:
        data = {"client-a": os.urandom(3 * MiB), "client-b": os.urandom(3 * MiB)}
        futs = [ep.send(arbiter.address, data[ep.name], {"from": ep.name}) for ep in (a, b)]
        msgs = [arbiter.recv(timeout=30) for _ in futs]
        for f in futs:
            f.result(30)
        assert sorted(m.metadata["from"] for m in msgs) == ["client-a", "client-b"]
        for m in msgs:
            assert crc32c.crc32c(m.view) == crc32c.crc32c(data[m.metadata["from"]])
        for m in msgs:
            m.release()


def test_one_client_cannot_take_the_others_part_fedrdma_e(caplog):
    """client-a's first upload is held by the application; its second would need another slot grown past its half
    of the budget and is refused, naming the request only, while client-b's upload still arrives. (Without the
    per-peer part the second would fit the budget, and client-b's would be the one refused.)"""
    caplog.set_level(logging.INFO, logger="fate_rdma.channel")
    with Endpoint(cfg("fedrdma-e"), name="arbiter") as arbiter, Endpoint(cfg("fedrdma-e"), name="client-a") as a, \
            Endpoint(cfg("fedrdma-e"), name="client-b") as b:
        a.send(arbiter.address, os.urandom(3 * MiB)).result(30)
        first = arbiter.recv(timeout=30)  # held: slot 0 stays grown to 3 MiB
        with pytest.raises(E.PayloadTooLarge) as err:
            a.send(arbiter.address, bytes(3 * MiB)).result(30)
        reason = told(err.value)
        assert reason.startswith(f"payload of {3 * MiB} bytes: growing receive slot 1 to {3 * MiB} bytes")
        assert_discloses_no_budget(reason, 3 * MiB, 1)
        data = os.urandom(3 * MiB)
        b.send(arbiter.address, data).result(30)
        msg = arbiter.recv(timeout=30)
        assert msg.peer == "client-b" and crc32c.crc32c(msg.view) == crc32c.crc32c(data)
        msg.release()
        first.release()
    explained = [r.getMessage() for r in caplog.records if "of receive memory to client-a" in r.getMessage()]
    assert len(explained) == 1 and f"{BUDGET}" in explained[0]  # the figures stay in the receiver's log


def test_one_client_cannot_take_the_others_part_fedrdma():
    """FedRDMA: a reassembly buffer past the peer's half is refused at the first chunk; the other client's
    upload (3 MiB) arrives all the same."""
    with Endpoint(cfg("fedrdma"), name="arbiter") as arbiter, Endpoint(cfg("fedrdma"), name="client-a") as a, \
            Endpoint(cfg("fedrdma"), name="client-b") as b:
        with pytest.raises(E.PayloadTooLarge) as err:
            a.send(arbiter.address, bytes(5 * MiB)).result(30)
        assert_discloses_no_budget(told(err.value), 5 * MiB)
        data = os.urandom(3 * MiB)
        b.send(arbiter.address, data).result(30)
        msg = arbiter.recv(timeout=30)
        assert msg.peer == "client-b" and crc32c.crc32c(msg.view) == crc32c.crc32c(data)
        msg.release()
        assert arbiter.budget.held_by("client-a") < MiB  # its staging buffers only: nothing kept of the refusal
