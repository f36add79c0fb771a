"""The lab's `fate-rdma` subcommands (bench, demo, eval, sweep, vm, wan), one module each, registered as
`fate_rdma.commands` entry points in lab/pyproject.toml."""
