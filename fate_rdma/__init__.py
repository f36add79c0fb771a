"""fate-rdma: move FATE federation payloads (model weights) over a chunked RDMA channel.

Layers (arrows point down only): federation -> grpc_compat -> channel -> protocol (sans-IO) ->
easypyverbs (pyverbs or the soft provider).
"""
__version__ = "0.1.0"
