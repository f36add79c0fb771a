"""The project's OSX-compatible message queue for tests: it lives in fate_rdma_lab.bench.osx_queue (so that
`fate-rdma eval fate` can run it in a testbed site); this module re-exports it for the tests."""
from fate_rdma_lab.bench.osx_queue import make_servicer, serve

__all__ = ["make_servicer", "serve"]
