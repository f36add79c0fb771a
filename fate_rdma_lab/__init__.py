"""fate-rdma's lab: the benches, the WAN testbed, the evaluation, the LoRA sweep, the Soft-RoCE VM runner and
the demo. It measures and exercises the product (`fate_rdma`, `easypyverbs`) and is installed beside it
(`pip install -e ./lab`); the product never imports it. Its commands join `fate-rdma` as subcommands through
the `fate_rdma.commands` entry points.
"""
