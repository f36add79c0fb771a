"""FATE's own OSX (FATE v2.2.0's java/osx) for tests: built once per machine from ../shared/third_party
(build-osx.sh: Java 17 + Maven Central, ~4 min cold), cached under ~/.cache/fate-rdma/osx-<digest of the
sources' script and patch>, and started per site with a site's broker settings and route table (the keys
`fate-rdma site init` writes, set over OSX's own files). Tests skip, saying why, where ../shared, Java or Maven
is missing or the build fails."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Dict, Optional

import pytest

from fate_rdma_lab.testbed.bed import call_in_ns, in_ns

ROOT = Path(__file__).resolve().parents[1]
THIRD_PARTY = ROOT.parent / "shared" / "third_party"


def cache_root() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "fate-rdma"


def built_osx() -> Path:
    """The built OSX folder (lib/, pb_lib/, conf/), building it once; pytest.skip where it cannot be had."""
    script = THIRD_PARTY / "build-osx.sh"
    if not script.exists():
        pytest.skip(f"FATE's OSX source is not here ({THIRD_PARTY} holds it on the project's machines)")
    for tool in ("java", "javac", "mvn"):
        if shutil.which(tool) is None:
            pytest.skip(f"building FATE's OSX needs {tool} (apt-get install openjdk-17-jdk-headless maven)")
    digest = hashlib.sha256(script.read_bytes() + (THIRD_PARTY / "fate-osx-java17.patch").read_bytes()).hexdigest()
    out = cache_root() / f"osx-2.2.0-{digest[:12]}"
    if (out / ".built").exists():
        return out
    log = cache_root() / "osx-build.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        r = subprocess.run(["bash", str(script), str(out)], stdout=f, stderr=subprocess.STDOUT, timeout=1200)
    if r.returncode != 0:
        pytest.skip(f"FATE's OSX did not build here (no Maven Central?): {log.read_text()[-800:]}")
    (out / ".built").write_text("ok\n")
    return out


def _set_keys(text: str, keys: Dict[str, str]) -> str:
    for k, v in keys.items():
        line = f"{k}={v}"
        text, n = re.subn(rf"^\s*{re.escape(k)}\s*=.*$", line, text, flags=re.M)
        if n == 0:
            text += f"\n{line}\n"
    return text


class OSX:
    """One site's OSX process, from the built folder and that site's `site init` pieces."""

    def __init__(self, built: Path, home: Path, site_osx: Path, netns: Optional[str] = None) -> None:
        self.home = home
        self.netns = netns  # the site's network namespace, or None
        conf = home / "conf"
        shutil.copytree(built / "conf", conf)
        props = conf / "broker" / "broker.properties"
        wanted = dict(line.split("=", 1) for line in (site_osx / "broker.properties").read_text().splitlines()
                      if "=" in line and not line.startswith("#"))
        props.write_text(_set_keys(props.read_text(), wanted))
        shutil.copy(site_osx / "route_table.json", conf / "broker" / "route_table.json")
        self.port = int(wanted["grpc.port"])
        self.log = home / "osx.out"
        cp = f"{conf / 'broker'}/:{built / 'lib'}/*:{built / 'pb_lib' / 'v3'}/*"
        argv = ["java", "-Xmx512m", "-cp", cp, "org.fedai.osx.broker.Bootstrap", "-c", str(conf)]
        self.proc: Optional[subprocess.Popen] = subprocess.Popen(
            in_ns(netns, argv) if netns else argv, cwd=str(home),
            stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True)

    def wait_up(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"OSX exited with {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            try:
                call_in_ns(self.netns, lambda: socket.create_connection(("127.0.0.1", self.port), timeout=1).close())
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"OSX did not listen on {self.port} within {timeout_s:g} s: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            from fate_rdma_lab.bench.local import stop_group

            stop_group(self.proc)
        self.proc = None
