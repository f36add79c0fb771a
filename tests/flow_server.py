"""A real FATE-Flow 2.2 server for tests: standalone engines, sqlite, its own home under a temp dir.

FATE-Flow derives every path (conf, logs, jobs, data, sqlite) from where its package lies, and
`fate_flow init --home` rewrites the installed package's settings.py. To leave the environment
untouched, the home gets a copy of the package in FATE's deployed layout (`HOME/python/fate_flow`,
`HOME/conf`, `HOME/fateflow.env`); the server and its task workers import that copy (PYTHONPATH)
and run on this environment's Python, where fate, fate_llm and fate_rdma are installed.
Stopped by PID, with every process it started (task workers) found by PID and ended too.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from typing import Any, Dict, List, Optional

from fate_rdma_lab.bench.local import free_ports
from fate_rdma_lab.testbed.bed import call_in_ns, in_ns


def free_port() -> int:
    return free_ports(1)[0]  # below the ephemeral range: not taken by an outgoing connection before it is bound


#: settings.py's paths that `fate_flow init --home` rewrites in the installed package (a user's init of this
#: venv's fate-flow): the copy takes this home's instead, so that no test server shares a user's database,
#: logs or conf
_SETTINGS_PATHS = {"DATA_DIR": "data", "MODEL_DIR": "model", "JOB_DIR": "jobs", "LOG_DIR": "logs",
                   "UPLOAD_DATA_HOME": "upload", "SQLITE_FILE_NAME": "fate_flow_sqlite.db",
                   "DEFAULT_SERVER_CONF_PATH": "conf"}


def _own_paths(settings: str, home: str) -> None:
    """The copied settings.py with every path `fate_flow init --home` may have set pointing into `home`."""
    import re

    with open(settings) as f:
        text = f.read()
    for key, sub in _SETTINGS_PATHS.items():
        if re.search(rf"^{key}\s*=\s*\"/", text, flags=re.M):  # (an absolute path: a user's init set it)
            text = re.sub(rf"^{key}\s*=.*$", f'{key} = "{os.path.join(home, sub)}"', text, flags=re.M)
    with open(settings, "w") as f:
        f.write(text)


class FlowServer:
    def __init__(self, home: str, party_id: str = "9999", env: Optional[Dict[str, str]] = None,
                 netns: Optional[str] = None) -> None:
        self.home = os.path.abspath(home)
        self.netns = netns  # a network namespace the server runs in (its HTTP reached there), or None
        self.party_id = party_id
        self.http_port = free_port()
        self.grpc_port = free_port()
        self.extra_env = env or {}
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = os.path.join(self.home, "server.out")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    # -- set-up -----------------------------------------------------------------------------------
    def prepare(self) -> None:
        import fate_flow
        import yaml

        src = os.path.dirname(os.path.abspath(fate_flow.__file__))
        dst = os.path.join(self.home, "python", "fate_flow")
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        _own_paths(os.path.join(dst, "settings.py"), self.home)
        shutil.copytree(os.path.join(src, "conf"), os.path.join(self.home, "conf"))
        shutil.copy(os.path.join(src, "fateflow.env"), os.path.join(self.home, "fateflow.env"))
        conf_path = os.path.join(self.home, "conf", "service_conf.yaml")
        with open(conf_path) as f:
            conf = yaml.safe_load(f)
        conf["party_id"] = self.party_id
        conf["fateflow"].update(host="127.0.0.1", http_port=self.http_port, grpc_port=self.grpc_port)
        conf["default_engines"] = {"computing": "standalone", "federation": "standalone", "storage": "standalone"}
        conf["database"]["engine"] = "sqlite"
        # the osx section's port would otherwise name a fixed 9370; nothing listens there in standalone
        conf.setdefault("federation", {}).setdefault("osx", {})["port"] = free_port()
        with open(conf_path, "w") as f:
            yaml.safe_dump(conf, f)
        jdc_path = os.path.join(self.home, "conf", "job_default_config.yaml")
        with open(jdc_path) as f:
            jdc = yaml.safe_load(f)
        jdc["job_cores"] = 1  # 2-core CI machines: three parties' tasks must all get their cores at once
        jdc["task_run"]["standalone"]["cores"] = 1
        jdc["computing_partitions"] = 1
        with open(jdc_path, "w") as f:
            yaml.safe_dump(jdc, f)

    def env(self) -> Dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(self.home, "python"), env.get("PYTHONPATH")) if p)
        env.pop("FATE_RDMA_CONF", None)
        env.update(self.extra_env)
        return env

    def start(self, timeout_s: float = 90) -> None:
        self.prepare()
        server_py = os.path.join(self.home, "python", "fate_flow", "fate_flow_server.py")
        with open(self.log_path, "wb") as out:
            argv = [sys.executable, server_py]
            self.proc = subprocess.Popen(in_ns(self.netns, argv) if self.netns else argv, cwd=self.home, env=self.env(),
                                         stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fate-flow server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if self.get("/v2/server/fateflow").get("code") == 0:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.5)
        else:
            self.stop()
            raise RuntimeError(f"fate-flow server did not answer on {self.address} within {timeout_s:g} s:\n{self.tail()}")
        # the server registers its providers before it answers; FATE's fails only in the server's log
        if not self.get("/v2/provider/query", name="fate").get("data"):
            self.stop()
            raise RuntimeError(f"fate-flow registered no 'fate' provider; see {self.home}/logs/fate_flow/fate_flow_stat.log")

    def tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    # -- HTTP API ---------------------------------------------------------------------------------
    def _url(self, path: str, params: Optional[Dict[str, Any]] = None) -> str:
        q = ("?" + urllib.parse.urlencode(params)) if params else ""
        return f"http://{self.address}{path}{q}"

    def _fetch(self, req: Any, timeout_s: float) -> Dict[str, Any]:
        def fetch() -> Dict[str, Any]:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return json.loads(r.read())

        return call_in_ns(self.netns, fetch, timeout_s=timeout_s + 10)

    def get(self, path: str, **params: Any) -> Dict[str, Any]:
        return self._fetch(self._url(path, params), 30)

    def post(self, path: str, body: Dict[str, Any]) -> Dict[str, Any]:
        req = urllib.request.Request(self._url(path), data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        return self._fetch(req, 60)

    def bind_path(self, namespace: str, name: str, path: str) -> None:
        resp = self.post("/v2/table/bind/path", {"namespace": namespace, "name": name, "path": path})
        if resp.get("code") != 0:
            raise RuntimeError(f"bind {namespace}.{name} -> {path}: {resp}")

    def submit(self, dag: Dict[str, Any]) -> str:
        resp = self.post("/v2/job/submit", {"dag_schema": dag})
        if resp.get("code") != 0:
            raise RuntimeError(f"job submit refused: {resp}")
        return resp["job_id"]

    def job(self, job_id: str) -> Dict[str, Any]:
        resp = self.get("/v2/job/query", job_id=job_id)
        if resp.get("code") != 0:
            raise RuntimeError(f"job query {job_id}: {resp}")
        return resp["data"][0]

    def wait(self, job_id: str, timeout_s: float = 300) -> str:
        deadline = time.monotonic() + timeout_s
        status = "?"
        while time.monotonic() < deadline:
            status = self.job(job_id)["status"]
            if status in ("success", "failed", "canceled", "timeout"):
                return status
            time.sleep(1)
        self.post("/v2/job/stop", {"job_id": job_id})
        raise TimeoutError(f"job {job_id} still {status} after {timeout_s:g} s")

    def tasks(self, job_id: str) -> List[Dict[str, Any]]:
        return self.get("/v2/job/task/query", job_id=job_id).get("data") or []

    def job_log_dir(self, job_id: str) -> str:
        return os.path.join(self.home, "logs", job_id)

    def task_logs(self, job_id: str) -> Dict[str, str]:
        """Every log file of the job's tasks, by path relative to the job's log folder."""
        out: Dict[str, str] = {}
        root = self.job_log_dir(job_id)
        for d, _, files in os.walk(root):
            for fn in files:
                p = os.path.join(d, fn)
                with open(p, errors="replace") as f:
                    out[os.path.relpath(p, root)] = f.read()
        return out

    # -- teardown ---------------------------------------------------------------------------------
    def descendants(self) -> List[int]:
        import psutil

        if self.proc is None:
            return []
        try:
            return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self, timeout_s: float = 15) -> List[int]:
        """End the server and every process it started, by PID; returns the PIDs still alive (none)."""
        import psutil

        if self.proc is None:
            return []
        pids = [self.proc.pid] + self.descendants()
        procs = []
        for pid in pids:
            try:
                p = psutil.Process(pid)
                p.send_signal(signal.SIGTERM)
                procs.append(p)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=timeout_s)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(alive, timeout=5)
        if self.proc.poll() is None:
            self.proc.wait(5)
        return [p.pid for p in alive]
