"""A real Apache Pulsar broker for tests: Pulsar's own standalone mode (broker, bookie and a RocksDB metadata
store in one JVM), from `org.apache.pulsar:pulsar-broker` and its dependencies as Maven Central serves them
(resolved once per machine into ~/.cache/fate-rdma/pulsar-broker-<version>/lib, ~235 MB, about a minute), no
tarball. Started per test module with its own data folder and ports, bound to a site's address (in that site's
network namespace where one is given), and stopped by PID. Tests skip, saying why, where Java or Maven is missing
or the jars cannot be had."""
from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from fate_rdma_lab.bench.local import free_ports, stop_group
from fate_rdma_lab.testbed.bed import in_ns
from osx_real import cache_root
from rabbitmq_node import fetch_json

VERSION = "4.0.7"
POM = f"""<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>fate-rdma.tests</groupId><artifactId>pulsar-standalone</artifactId><version>1</version>
  <dependencies>
    <dependency><groupId>org.apache.pulsar</groupId><artifactId>pulsar-broker</artifactId>
      <version>{VERSION}</version></dependency>
  </dependencies>
</project>
"""


def pulsar_jars() -> Path:
    """The folder of pulsar-broker's jars, resolved once; pytest.skip where they cannot be had."""
    for tool in ("java", "mvn"):
        if shutil.which(tool) is None:
            pytest.skip(f"a Pulsar broker needs {tool} (apt-get install openjdk-17-jdk-headless maven)")
    out = cache_root() / f"pulsar-broker-{VERSION}"
    if (out / ".resolved").exists():
        return out / "lib"
    out.mkdir(parents=True, exist_ok=True)
    (out / "pom.xml").write_text(POM)
    log = out / "resolve.log"
    with open(log, "w") as f:
        r = subprocess.run(["mvn", "-q", "-B", "dependency:copy-dependencies", "-DoutputDirectory=lib"], cwd=out,
                           stdout=f, stderr=subprocess.STDOUT, timeout=900)
    if r.returncode != 0:
        pytest.skip(f"pulsar-broker {VERSION} did not resolve from Maven Central: {log.read_text()[-800:]}")
    (out / ".resolved").write_text("ok\n")
    return out / "lib"


class PulsarNode:
    """One standalone broker at `host` (its namespace `netns`): `port` (binary protocol) and `web_port` (admin
    REST, which FATE's pulsar engine drives) once started."""

    cluster = "standalone"
    engine = "pulsar"  # (FATE-Flow's name for the engine this broker serves)

    @property
    def data_port(self) -> int:
        return self.port

    def __init__(self, base: str, host: str = "127.0.0.1", netns: Optional[str] = None) -> None:
        self.base = Path(base).resolve()
        self.host, self.netns = host, netns
        self.port, self.web_port, self.bookie_port = free_ports(3)
        self.proc: Optional[subprocess.Popen] = None
        self.log = self.base / "pulsar.out"

    def start(self, deadline_s: float = 180.0) -> "PulsarNode":
        lib = pulsar_jars()
        self.base.mkdir(parents=True, exist_ok=True)
        conf = self.base / "standalone.conf"
        conf.write_text("\n".join([
            f"clusterName={self.cluster}", f"bindAddress={self.host}", f"advertisedAddress={self.host}",
            f"brokerServicePort={self.port}", f"webServicePort={self.web_port}",
            "managedLedgerDefaultEnsembleSize=1", "managedLedgerDefaultWriteQuorum=1",
            "managedLedgerDefaultAckQuorum=1", "authenticationEnabled=false", "authorizationEnabled=false",
            "functionsWorkerEnabled=false", "transactionCoordinatorEnabled=false", "allowAutoTopicCreation=true",
            "brokerShutdownTimeoutMs=3000", ""]))
        argv = ["java", "-Xmx1g", "-XX:MaxDirectMemorySize=1g", "-cp", f"{lib}/*",
                "org.apache.pulsar.PulsarStandaloneStarter", "--config", str(conf), "--no-functions-worker",
                "--no-stream-storage", "--bookkeeper-dir", str(self.base / "bookkeeper"), "--metadata-dir",
                str(self.base / "metadata"), "--bookkeeper-port", str(self.bookie_port), "--wipe-data"]
        self.proc = subprocess.Popen(in_ns(self.netns, argv) if self.netns else argv, cwd=str(self.base),
                                     stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.monotonic()
        while self.admin("GET", "clusters") != [self.cluster]:
            if self.proc.poll() is not None:
                raise RuntimeError(f"Pulsar exited with {self.proc.returncode}: {self.tail()}")
            if time.monotonic() - t0 > deadline_s:
                raise RuntimeError(f"Pulsar's admin API at {self.host}:{self.web_port} not up within {deadline_s:g} "
                                   f"s: {self.tail()}")
            time.sleep(0.5)
        self.boot_s = time.monotonic() - t0
        return self

    def admin(self, method: str, path: str, timeout: float = 5) -> Any:
        req = urllib.request.Request(f"http://{self.host}:{self.web_port}/admin/v2/{path}", method=method)
        return fetch_json(req, timeout, self.netns)

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def service_conf(self) -> Dict[str, Any]:
        """FATE-Flow's `federation.pulsar` for this broker, in FATE's `client` mode (every party on it)."""
        return {"host": self.host, "port": self.port, "mng_port": self.web_port, "cluster": self.cluster,
                # FATE slices larger messages: the broker takes 5 MB frames, its bookie no more (a larger message
                # made the bookie reset the broker's connections, and FATE's produce time out)
                "tenant": "fl-tenant", "topic_ttl": 30, "mode": "client", "max_message_size": 1 << 20}

    def route_table(self, party_ids) -> Dict[str, Any]:
        return {pid: {"host": self.host, "port": self.port, "sslPort": self.port, "proxy": ""} for pid in party_ids}

    def stop(self) -> List[int]:
        """Stop the broker (its process group); returns the PIDs still alive afterwards (none)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return []
        if proc.poll() is None:
            stop_group(proc)
        return [proc.pid] if proc.poll() is None else []
