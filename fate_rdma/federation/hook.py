"""The start-up hook: a `.pth` file imports this module in every interpreter of the environment.

It only adds an import finder that patches four FATE modules when (and if) they are imported:
FederationBuilder (to wrap federations when fate-rdma is configured), the federation serializer
(array frames, only for federations fate-rdma wrapped), the task-config spec (to see a
`fate_rdma` section in a fate-flow task conf) and the multiprocess launcher (which, when fate-rdma is
configured, stops a job whose party process died without reporting: launcher.py). Nothing else
happens; FATE jobs without a fate-rdma configuration run exactly as before.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import sysconfig
from typing import Any, Optional

PTH_NAME = "fate_rdma_hook.pth"
PTH_LINE = "import fate_rdma.federation.hook as _h; _h.install_import_hook()\n"
_TARGETS = {
    "fate.arch.federation._builder": lambda m: _activate().patch_builder(m.FederationBuilder),
    "fate.arch.federation.api._serdes": lambda m: _activate().patch_serdes(m.TableRemotePersistentPickler,
                                                                           m.TableRemotePersistentUnpickler),
    "fate.components.core.spec.task": lambda m: _activate().capture_task_conf(m.TaskConfigSpec),
    "fate.arch.launchers.multiprocess_launcher": lambda m: _launcher().patch_launcher(m.MultiProcessLauncher),
}


def _activate() -> Any:
    from . import activate

    return activate


def _launcher() -> Any:
    from . import launcher

    return launcher


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if name not in _TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader  # (its exec_module is replaced below)
        after = _TARGETS[name]
        orig_exec = loader.exec_module

        def exec_module(module: Any) -> None:
            orig_exec(module)
            try:
                after(module)
            except Exception as exc:  # never break FATE's import
                sys.stderr.write(f"fate-rdma: hook for {name} failed: {exc}\n")

        loader.exec_module = exec_module
        return spec


def install_import_hook() -> None:
    if os.environ.get("FATE_RDMA_DISABLE_HOOK"):
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    for name, after in _TARGETS.items():  # already imported (e.g. hook installed late)
        if name in sys.modules:
            after(sys.modules[name])


def pth_path() -> str:
    return os.path.join(sysconfig.get_paths()["purelib"], PTH_NAME)
