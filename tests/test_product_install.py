"""The product installs alone: its wheel holds fate_rdma and easypyverbs only, names no lab dependency, and
`fate-rdma --help` and `fate-rdma doctor` work in a fresh environment without the lab (whose subcommands are
then absent). Builds the wheel and a venv with pip (PyPI or pip's cache): a system test."""
from __future__ import annotations

import email
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parent.parent
LAB_DEPENDENCIES = ("matplotlib", "mooncake", "fate-rdma-lab")
LAB_COMMANDS = ("bench", "demo", "eval", "sweep", "vm", "wan")


def run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)


@pytest.fixture(scope="module")
def product_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # built from a copy of the files git tracks or would track, so that no build/ folder is left in the checkout
    src = out / "src"
    for name in run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT).stdout.split():
        if not (ROOT / name).is_file():  # deleted, not yet committed
            continue
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    r = run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)])
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = out.glob("fate_rdma-*.whl")
    return wheel


def test_the_wheel_holds_the_product_only(product_wheel: Path) -> None:
    with zipfile.ZipFile(product_wheel) as z:
        names = z.namelist()
        meta = email.message_from_string(z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode())
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"fate_rdma", "easypyverbs"}, tops
    assert "fate_rdma/py.typed" in names and "easypyverbs/py.typed" in names
    requires = [r.lower() for r in meta.get_all("Requires-Dist") or []]
    plain = [r for r in requires if "extra ==" not in r]
    assert not [r for r in requires for dep in LAB_DEPENDENCIES if r.startswith(dep)], requires
    assert any(r.startswith("numpy") for r in plain) and any(r.startswith("grpcio") for r in plain)


def test_fate_rdma_works_without_the_lab(product_wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    assert run([sys.executable, "-m", "venv", str(venv)]).returncode == 0
    py = venv / "bin" / "python"
    r = run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(product_wheel)])
    if r.returncode != 0 and ("No matching distribution" in r.stderr or "Could not find a version" in r.stderr
                              or "NewConnectionError" in r.stderr):
        pytest.skip(f"the product's dependencies cannot be installed here (no PyPI, no pip cache): {r.stderr[-500:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    listed = run([str(py), "-m", "pip", "list", "--format=freeze"]).stdout.lower()
    assert not [d for d in LAB_DEPENDENCIES if d in listed], listed
    helped = run([str(venv / "bin" / "fate-rdma"), "--help"], cwd=tmp_path)
    assert helped.returncode == 0, helped.stderr
    for command in ("doctor", "launch", "flow", "site", "secret", "tls", "hook", "exporter", "top"):
        assert command in helped.stdout
    shown = helped.stdout.split("options:")[0]
    assert not [c for c in LAB_COMMANDS if f"\n    {c} " in shown], shown
    missing = run([str(venv / "bin" / "fate-rdma"), "bench"], cwd=tmp_path)
    assert missing.returncode == 2 and "invalid choice: 'bench'" in missing.stderr
    doctor = run([str(venv / "bin" / "fate-rdma"), "doctor"], cwd=tmp_path)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "soft" in doctor.stdout
