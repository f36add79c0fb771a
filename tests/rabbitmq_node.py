"""A real RabbitMQ node (Debian's rabbitmq-server, deploy/install-rabbitmq.sh) as a child process, for
tests: its own data, log and config under a folder, its own node name, AMQP, management-HTTP and
Erlang distribution ports, and its own epmd (started here, on its own port, loopback only), so it
neither needs nor touches a system-wide RabbitMQ. `stop()` ends everything it started, by PID."""
from __future__ import annotations

import glob
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from base64 import b64encode
from typing import Dict, List, Optional

from fate_rdma_lab.bench.local import free_ports
from fate_rdma_lab.testbed.bed import call_in_ns, in_ns

SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"
INSTALL_HINT = "run deploy/install-rabbitmq.sh as root (`make test` does), i.e. apt-get install rabbitmq-server"


def unavailable() -> Optional[str]:
    """Why a RabbitMQ node cannot be started here, or None."""
    if not os.path.exists(SERVER):
        return f"RabbitMQ is not installed ({SERVER} missing): {INSTALL_HINT}"
    if not glob.glob("/usr/lib/rabbitmq/lib/rabbitmq_server-*/plugins/rabbitmq_management-*"):
        return f"RabbitMQ's management plugin is missing (FATE's rabbitmq engine needs its HTTP API): {INSTALL_HINT}"
    for tool in ("erl", "epmd"):
        if not any(os.access(os.path.join(d, tool), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep) + ["/usr/bin"]):
            return f"Erlang's `{tool}` is not on PATH (it comes with rabbitmq-server): {INSTALL_HINT}"
    return None


def listening(port: int, host: str = "127.0.0.1", netns: Optional[str] = None) -> bool:
    def probe() -> bool:
        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex((host, port)) == 0

    return bool(call_in_ns(netns, probe))


def fetch_json(req: urllib.request.Request, timeout_s: float, netns: Optional[str] = None) -> Optional[object]:
    """The JSON an HTTP API answers `req` with (from inside `netns`), or None where it does not (yet) answer."""
    import json

    def fetch() -> Optional[object]:
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                body = r.read()
                return json.loads(body) if body else {}
        except (urllib.error.URLError, OSError, ValueError):
            return None

    return call_in_ns(netns, fetch, timeout_s=timeout_s + 10)


class RabbitNode:
    """One node. `amqp_port`, `mng_port`, `user`, `password` once started; `options()` is what
    FATE's FederationBuilder.build_rabbitmq takes (client mode: every party uses this one broker)."""

    user = "fate"

    def __init__(self, base: str, host: str = "127.0.0.1", netns: Optional[str] = None) -> None:
        self.base = os.path.abspath(base)
        self.host = host  # where AMQP and management listen (epmd and distribution stay on loopback)
        self.netns = netns  # the network namespace the node runs in (a site's), or None
        self.name = f"fate-rdma-test-{secrets.token_hex(4)}@localhost"
        self.password = secrets.token_hex(8)
        self.amqp_port, self.mng_port, self.dist_port, self.epmd_port = free_ports(4)
        self.proc: Optional[subprocess.Popen] = None
        self.epmd: Optional[subprocess.Popen] = None
        self.pids: List[int] = []
        self.log_path = os.path.join(self.base, "server.out")

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, deadline_s: float = 90.0) -> "RabbitNode":
        os.makedirs(self.base, exist_ok=True)
        with open(os.path.join(self.base, "rabbitmq.conf"), "w") as f:
            f.write(f"listeners.tcp.default = {self.host}:{self.amqp_port}\n"
                    f"management.tcp.ip = {self.host}\nmanagement.tcp.port = {self.mng_port}\n"
                    f"default_user = {self.user}\ndefault_pass = {self.password}\n"
                    "default_user_tags.administrator = true\n"
                    # a test machine's disk may be nearly full: do not block publishers for it
                    "disk_free_limit.absolute = 1MB\n"
                    "collect_statistics_interval = 1000\n")
        with open(os.path.join(self.base, "enabled_plugins"), "w") as f:
            f.write("[rabbitmq_management].\n")
        cookie = os.path.join(self.base, ".erlang.cookie")  # HOME is self.base: the node's cookie
        if not os.path.exists(cookie):
            with open(os.open(cookie, os.O_WRONLY | os.O_CREAT, 0o400), "w") as f:
                f.write(secrets.token_hex(16).upper())
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": self.base, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "ERL_EPMD_PORT": str(self.epmd_port), "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODENAME": self.name, "RABBITMQ_NODE_IP_ADDRESS": self.host,
            "RABBITMQ_NODE_PORT": str(self.amqp_port), "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": os.path.join(self.base, "mnesia"),
            "RABBITMQ_LOG_BASE": os.path.join(self.base, "log"),
            "RABBITMQ_CONFIG_FILE": os.path.join(self.base, "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": os.path.join(self.base, "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": os.path.join(self.base, "rabbitmq-env.conf"),  # not /etc/rabbitmq's
            "RABBITMQ_ENABLED_PLUGINS_FILE": os.path.join(self.base, "enabled_plugins"),
            "RABBITMQ_PLUGINS_EXPAND_DIR": os.path.join(self.base, "plugins-expand"),
            "RABBITMQ_PID_FILE": os.path.join(self.base, "rabbitmq.pid"),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }
        out = open(self.log_path, "ab")
        try:
            # our own epmd in the foreground, so that it is ours to stop (erl would start a daemon)
            self.epmd = subprocess.Popen(self._argv(["epmd", "-address", "127.0.0.1", "-port", str(self.epmd_port)]),
                                         env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            self.pids.append(self.epmd.pid)
            t_end = time.monotonic() + 10
            while not listening(self.epmd_port, netns=self.netns):
                if self.epmd.poll() is not None or time.monotonic() > t_end:
                    raise RuntimeError(f"epmd did not listen on 127.0.0.1:{self.epmd_port}: {self.log_tail()}")
                time.sleep(0.05)
            self.proc = subprocess.Popen(self._argv([SERVER]), env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.base)
            self.pids.append(self.proc.pid)
        finally:
            out.close()
        t0 = time.monotonic()
        while True:
            self._remember_descendants()
            if self.proc.poll() is not None:
                raise RuntimeError(f"RabbitMQ node {self.name} exited with code {self.proc.returncode} while "
                                   f"starting:\n{self.log_tail()}")
            if listening(self.amqp_port, self.host, self.netns) and self._api("GET", "overview", timeout=2) is not None:
                break
            if time.monotonic() - t0 > deadline_s:
                raise RuntimeError(f"RabbitMQ node {self.name} not ready within {deadline_s:g} s (AMQP "
                                   f"{self.host}:{self.amqp_port}, management {self.mng_port}):\n{self.log_tail()}")
            time.sleep(0.25)
        self.boot_s = time.monotonic() - t0
        self._remember_descendants()
        return self

    def stop(self, deadline_s: float = 30.0) -> List[int]:
        """Stop the node (SIGTERM: RabbitMQ shuts down cleanly), then epmd; SIGKILL whatever is left
        after the deadline. Returns the PIDs still alive afterwards (should be [])."""
        import psutil

        self._remember_descendants()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(deadline_s)
            except subprocess.TimeoutExpired:
                pass
        if self.epmd is not None and self.epmd.poll() is None:
            self.epmd.terminate()
            try:
                self.epmd.wait(5)
            except subprocess.TimeoutExpired:
                pass
        t_end = time.monotonic() + 5
        while self._alive() and time.monotonic() < t_end:
            time.sleep(0.1)
        for pid in self._alive():
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        for p in (self.proc, self.epmd):
            if p is not None:
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    pass
        t_end = time.monotonic() + 5
        while self._alive() and time.monotonic() < t_end:
            time.sleep(0.1)
        return self._alive()

    def _remember_descendants(self) -> None:
        import psutil

        for root in list(self.pids[:2]):
            try:
                kids = psutil.Process(root).children(recursive=True)
            except psutil.Error:
                continue
            self.pids += [k.pid for k in kids if k.pid not in self.pids]

    def _alive(self) -> List[int]:
        import psutil

        alive = []
        for pid in self.pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.Error:
                pass
        return alive

    def log_tail(self, n: int = 4000) -> str:
        text = ""
        for path in [self.log_path] + sorted(glob.glob(os.path.join(self.base, "log", "*.log"))):
            try:
                with open(path, errors="replace") as f:
                    text += f"--- {os.path.basename(path)}\n" + f.read()[-n:]
            except OSError:
                pass
        return text

    # -- management API -------------------------------------------------------------------------
    def _api(self, method: str, path: str, timeout: float = 10) -> Optional[object]:
        req = urllib.request.Request(f"http://{self.host}:{self.mng_port}/api/{path}", method=method)
        req.add_header("Authorization", "Basic " + b64encode(f"{self.user}:{self.password}".encode()).decode())

        return fetch_json(req, timeout, self.netns)

    def _argv(self, argv: List[str]) -> List[str]:
        return in_ns(self.netns, argv) if self.netns else argv

    def vhosts(self) -> List[str]:
        got = self._api("GET", "vhosts")
        return sorted(v["name"] for v in got) if isinstance(got, list) else []

    def users(self) -> List[str]:
        got = self._api("GET", "users")
        return sorted(u["name"] for u in got) if isinstance(got, list) else []

    engine = "rabbitmq"  # (FATE-Flow's name for the engine this node serves)

    @property
    def data_port(self) -> int:
        return self.amqp_port

    def service_conf(self) -> Dict[str, object]:
        """FATE-Flow's `federation.rabbitmq` for this node, in FATE's `client` mode (every party on it)."""
        return {"host": self.host, "port": self.amqp_port, "mng_port": self.mng_port, "user": self.user,
                "password": self.password, "mode": "client", "max_message_size": 256 << 20}

    def route_table(self, party_ids: List[str]) -> Dict[str, object]:
        return {pid: {"host": self.host, "port": self.amqp_port} for pid in party_ids}

    def options(self) -> Dict[str, object]:
        """FederationBuilder.build_rabbitmq(computing, host, port, options) for this node, in FATE's
        `client` mode (one broker for all parties; `replication` federates queues between brokers)."""
        return {"host": self.host, "port": self.amqp_port, "mng_port": self.mng_port,
                "base_user": self.user, "base_password": self.password, "mode": "client",
                "route_table": {}, "max_message_size": None, "rabbitmq_run": {}, "connection": {}}
