"""Verbs providers: `soft` (verbs emulated over TCP, always available) and `pyverbs` (real RDMA)."""
