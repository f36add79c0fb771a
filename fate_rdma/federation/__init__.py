"""FATE glue: move large federation payloads over the fate-rdma channel, switched on from configuration.

Kept import-light: the `.pth` hook imports `fate_rdma.federation.hook` in every interpreter start.
"""
