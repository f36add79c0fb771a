"""The site's metrics exporter: one long-lived process serving every fate-rdma process's metrics to Prometheus.

Task processes write their samples into the site's `metrics_dir` (fate_rdma/metrics.py, prometheus-client's
multiprocess mode: a few memory-mapped files per process). On each scrape the exporter
  1. lets go of the live gauges (bytes in flight, registered memory, connections) of processes that have ended,
  2. folds the counters and histograms of ended processes into one archive file per kind and removes theirs,
     so that thousands of finished tasks do not make thousands of files to read, while what they counted stays
     counted (a file is renamed before it is folded, so that no failure folds it twice; an unreadable one is
     set aside as NAME.bad; one exporter at a time folds, under a lock file in the folder),
  3. serves the sum over what is left.
A process counts as ended when no process has its pid (kill(pid, 0)): the exporter must run on the host of the
tasks, in their PID namespace (the systemd unit in deploy/metrics does).
"""
from __future__ import annotations

import fcntl
import glob
import logging
import os
import re
import threading
from typing import Any, Dict, Iterable, List, Tuple

log = logging.getLogger("fate_rdma.exporter")

#: a process's file: kind (counter, histogram, summary, gauge_<mode>) and pid
_FILE = re.compile(r"^(counter|histogram|summary|gauge_[a-z]+)_(\d+)\.db$")
#: how an ended process's file folds into the archive: summed, or the max (min) kept; live gauges are dropped;
#: other gauges (all, mostrecent) stay as they are
_FOLD = {"counter": "sum", "histogram": "sum", "summary": "sum", "gauge_sum": "sum", "gauge_max": "max",
         "gauge_min": "min"}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's process)
        return True
    return True


def _files(directory: str) -> Iterable[Tuple[str, str, int]]:
    for path in glob.glob(os.path.join(directory, "*.db")):
        m = _FILE.match(os.path.basename(path))
        if m and not os.path.islink(path):
            yield path, m.group(1), int(m.group(2))


def _fold(value: float, old: float, how: str) -> float:
    return old + value if how == "sum" else max(old, value) if how == "max" else min(old, value)


def tidy(directory: str) -> Dict[str, int]:
    """Steps 1 and 2 of the module's doc, for the processes that have ended. Returns what it did:
    {"ended": processes, "folded": files folded into the archive, "dropped": live gauge files removed,
    "unreadable": files set aside as NAME.bad}. One exporter at a time (a lock file in `directory`); a file is
    renamed before it is folded, so that no failure folds it twice."""
    from prometheus_client.mmap_dict import MmapedDict

    done = {"ended": 0, "folded": 0, "dropped": 0, "unreadable": 0}
    ended = set()
    archives: Dict[str, Any] = {}
    with open(os.path.join(directory, ".exporter.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            for path, kind, pid in sorted(_files(directory)):
                if alive(pid):
                    continue
                ended.add(pid)
                how = _FOLD.get(kind)
                if kind.startswith("gauge_live"):  # (live gauges: the process's values end with it)
                    os.remove(path)
                    done["dropped"] += 1
                    continue
                if how is None:
                    continue
                taken = path[:-3] + ".folding"
                os.rename(path, taken)  # (from here the collector no longer reads it, nor does a later tidy)
                try:
                    values = [(k, v) for k, v, _ts, _pos in MmapedDict.read_all_values_from_file(taken)]
                except Exception as exc:  # (a truncated or corrupt file: set aside, named)
                    os.rename(taken, path[:-3] + ".bad")
                    log.warning("metrics file %s of ended process %d is unreadable (%s): set aside as .bad", path,
                                pid, exc)
                    done["unreadable"] += 1
                    continue
                arch = archives.get(kind)
                if arch is None:
                    arch = archives[kind] = MmapedDict(os.path.join(directory, f"{kind}_archive.db"))
                for key, value in values:
                    old, _ = arch.read_value(key)
                    arch.write_value(key, _fold(value, old, how), 0.0)
                os.remove(taken)
                done["folded"] += 1
        finally:
            for arch in archives.values():
                arch.close()
    done["ended"] = len(ended)
    return done


class SiteCollector:
    """A prometheus-client collector of `directory`: tidies it (under a lock), then sums every process's files."""

    def __init__(self, directory: str) -> None:
        from prometheus_client.multiprocess import MultiProcessCollector

        self.directory = directory
        self._lock = threading.Lock()
        self._inner = MultiProcessCollector(None, path=directory)

    def collect(self) -> List[Any]:
        with self._lock:
            try:
                did = tidy(self.directory)
                if did["folded"] or did["dropped"]:
                    log.info("metrics of %d ended processes: %d files folded into the archive, %d live gauges "
                             "dropped", did["ended"], did["folded"], did["dropped"])
            except Exception as exc:  # (a full disk, permissions: serve what is there)
                log.warning("could not tidy %s: %s", self.directory, exc)
            return list(self._inner.collect())


def serve(directory: str, host: str, port: int) -> Tuple[Any, str]:
    """Serve `directory`'s metrics on http://host:port/metrics (port 0: any free one) from a daemon thread.
    Returns the server (`shutdown()`) and its URL."""
    from prometheus_client import CollectorRegistry, start_http_server

    from prometheus_client import Gauge

    from . import __version__

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SiteCollector(directory))
    Gauge("fate_rdma_exporter_build_info", "The exporter's fate-rdma version (1)", ("version",),
          registry=registry).labels(__version__).set(1)
    server, _thread = start_http_server(port, host, registry=registry)
    shown = f"[{host}]" if ":" in host else host
    return server, f"http://{shown}:{server.server_port}/metrics"
