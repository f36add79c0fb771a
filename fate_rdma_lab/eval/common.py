"""What every `fate-rdma eval` study shares: its results folder, the honest header of its table, the
testbed it builds and always removes, the link as measured, markdown tables and matplotlib bars.

No side effects at import; matplotlib is imported (Agg) only when a plot is written.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, TextIO, Tuple

from fate_rdma_lab.testbed import bed as wan
from fate_rdma_lab.bench.report import loadavg  # noqa: F401  (re-exported to the eval modules)

MiB = 1 << 20
SOFT = "soft provider = emulation (verbs emulated over TCP), not RDMA"
#: the paper's Table 4 (FedRDMA, 1 GB transfer, GPT-2 setting, real 10 Gbit/s RDMA NIC, 20 ms RTT)
PAPER_TABLE4 = (("FedLLM (FATE gRPC)", 13.8, 24.6), ("FedRDMA", 60.0, 9.4), ("FedRDMA-E", 0.025, 6.0))


def machine() -> str:
    return (f"{platform.system()} {platform.release()} {platform.machine()}, {os.cpu_count()} cores (shared), "
            f"Python {platform.python_version()}")


def code() -> str:
    """Which fate-rdma made the figures: its version, the git commit of the checkout it runs from (and
    whether that has uncommitted changes), and the channel's default checksum (which every study uses)."""
    from fate_rdma import __version__
    from fate_rdma.config import ChannelConfig

    root = Path(__file__).resolve().parents[2]
    commit = "not a git checkout"
    if (root / ".git").exists():
        import subprocess

        commit = "commit unknown: git did not answer"
        try:
            sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True, timeout=10).stdout.strip()
            dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            if sha:
                commit = f"commit {sha}" + (" with uncommitted changes" if dirty else "")
        except (OSError, subprocess.SubprocessError):
            pass
    return f"fate-rdma {__version__} ({commit}); the channel's checksum: {ChannelConfig().checksum} (the default)"


def size(n: Optional[int]) -> str:
    if n is None:
        return "-"
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    return f"{n // 1024} KiB" if n % 1024 == 0 else f"{n} B"


def median(xs: Sequence[float]) -> Optional[float]:
    return float(statistics.median(xs)) if xs else None


def results_dir(out_root: Path, study: str) -> Path:
    """OUT/<UTC time>-<study>/ (a second run within the same second gets a suffix, never mixes rows)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = out_root / f"{stamp}-{study}"
    n = 1
    while out.exists():
        n += 1
        out = out_root / f"{stamp}-{study}-{n}"
    out.mkdir(parents=True)
    return out


@dataclasses.dataclass(frozen=True)
class LinkPlan:
    """A study on one shaped link: its rate and RTT, the payload, repetitions and the channel's chunk."""

    rate_mbit: float = 100.0
    rtt_ms: float = 20.0
    nbytes: int = 32 * MiB
    reps: int = 3
    chunk_bytes: int = 256 * 1024
    measure_s: float = 2.0

    def with_(self, **kw: Any) -> Any:
        """A copy with the options given (None: keep); ValueError where a value is out of range."""
        p = dataclasses.replace(self, **{k: v for k, v in kw.items() if v is not None})
        if p.nbytes <= 0 or p.reps <= 0 or p.rate_mbit <= 0 or p.rtt_ms < 0 or p.chunk_bytes < 4096:
            raise ValueError("--bytes, --reps and --rate-mbit must be positive, --rtt-ms >= 0, --chunk-bytes >= 4096")
        p.check()
        return p

    def check(self) -> None:
        """A study's own checks of its extra options."""


class Rows:
    """Result rows, each written to results.jsonl as it is made (a crash keeps what was measured)."""

    def __init__(self, folder: Path) -> None:
        self.rows: List[Dict[str, Any]] = []
        self._f: TextIO = open(folder / "results.jsonl", "w")

    def add(self, row: Dict[str, Any]) -> Dict[str, Any]:
        self.rows.append(row)
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        return row

    def close(self) -> None:
        self._f.close()

    def save(self, out: Path, lines: Sequence[str], plot: Callable[[], Any]) -> List[str]:
        """Close results.jsonl, write table.md and the plot (also after a failure: what was measured)."""
        self.close()
        (out / "table.md").write_text("\n".join(lines))
        plot()
        return list(lines)


def measured_link(measured: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The figures a row carries about its link: RTT (UDP echo median) and one TCP stream, as measured."""
    if not measured:
        return {"rtt_median_ms": None, "tcp_bps": None, "tcp_cc": None}
    return {"rtt_median_ms": measured.get("rtt", {}).get("median_ms"),
            "tcp_bps": (measured.get("tcp") or {}).get("bps"), "tcp_cc": measured.get("tcp_cc")}


def link_line(m: Dict[str, Any]) -> str:
    if m.get("rtt_median_ms") is None and m.get("tcp_bps") is None:
        return "loopback (no testbed)"
    rtt = f"{m['rtt_median_ms']:.2f} ms" if m.get("rtt_median_ms") is not None else "?"
    tcp = f"{wan.fmt_rate(m.get('tcp_bps'))} ({m.get('tcp_cc') or '?'})"
    return f"measured rtt {rtt} (UDP echo median), one TCP stream {tcp}"


def header(title: str, command: str, lines: Sequence[str]) -> List[str]:
    """The lines every table.md starts with: the command, machine, load, then the study's own."""
    return [f"# {title}", "", f"- command: `{command}`" if command else "- command: (library call)",
            f"- machine: {machine()}; load average at the end {loadavg()}",
            f"- date (UTC): {time.strftime('%Y-%m-%d %H:%M', time.gmtime())}", f"- code: {code()}",
            *[f"- {x}" for x in lines], ""]


def md_table(columns: Sequence[str], cells: Sequence[Sequence[Any]]) -> List[str]:
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in cells]
    return out + [""]


def print_md(lines: Sequence[str], log: Callable[[str], None], out: Path) -> None:
    """A table.md on the terminal: the same text (markdown tables are readable as they are)."""
    log("\n".join(lines))
    log(f"results: {out}")


@contextlib.contextmanager
def testbed(tb: wan.Testbed, measure_s: float, log: Callable[[str], None], src: int = 0,
            dst: int = 1) -> Iterator["Bed"]:
    """Build the testbed, measure site src -> dst; remove it whatever happens (also on Ctrl-C / SIGTERM)."""
    bed = Bed(tb, measure_s, log)
    try:
        bed.shape(tb, src, dst)
        yield bed
    finally:
        removed = wan.down(tb.prefix)
        left = wan.leftovers(tb.prefix)
        log(f"testbed {tb.prefix} removed ({len(removed)} items)" + (f"; LEFT BEHIND: {left}" if left else ""))


class Bed:
    """The testbed of one run: reshaped in place between links; its last measurement kept."""

    def __init__(self, tb: wan.Testbed, measure_s: float, log: Callable[[str], None]) -> None:
        self.tb, self.measure_s, self.log = tb, measure_s, log
        self.measured: Optional[Dict[str, Any]] = None

    def shape(self, tb: wan.Testbed, src: int = 0, dst: int = 1) -> Dict[str, Any]:
        self.tb = tb
        wan.up(tb, measure_seconds=-1)
        from fate_rdma_lab.testbed.run import measure

        self.measured = measure(tb, src, dst, seconds=self.measure_s, pings=5)
        m = measured_link(self.measured)
        self.log(f"link {tb.links[src].describe()}: {link_line(m)}")
        return m


@contextlib.contextmanager
def secret_file() -> Iterator[str]:
    """A throwaway federation secret for the endpoints in the sites (they listen off loopback)."""
    from fate_rdma.channel.auth import write_secret

    with tempfile.TemporaryDirectory(prefix="fate-rdma-eval-") as tmp:
        path = str(Path(tmp) / "secret")
        write_secret(path)
        yield path


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or None (and a line saying how to get it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install -e ./lab)", file=sys.stderr)
        return None
    return plt


def bars(path: Path, panels: Sequence[Tuple[str, List[str], Dict[str, List[Optional[float]]]]], ylabel: str,
         note: str, hline: Optional[Tuple[str, float]] = None) -> Optional[Path]:
    """Grouped bars, one panel per (title, x labels, {series: values}); None without matplotlib."""
    plt = pyplot()
    if plt is None or not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(min(6.5 * len(panels), 16), 4.2), squeeze=False)
    for ax, (title, xs, series) in zip(axes[0], panels):
        width = 0.8 / max(1, len(series))
        for j, (name, ys) in enumerate(series.items()):
            ax.bar([i + j * width for i in range(len(xs))], [y or 0 for y in ys], width, label=name)
        if hline:
            ax.axhline(hline[1], color="black", linewidth=0.8, linestyle="--", label=hline[0])
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(xs))], xs, rotation=20, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}\n{note}", fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
