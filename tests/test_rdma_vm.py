"""`fate-rdma vm`: what can be checked without booting (the boot itself is `make test-rdma`)."""
from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from fate_rdma_lab import vm as rdma_vm


def cli(*args):
    return subprocess.run([sys.executable, "-m", "fate_rdma.cli", "vm", *args], capture_output=True, text=True, timeout=60)


def test_run_without_a_command_is_a_usage_error():
    out = cli("run")
    assert out.returncode == 2 and "no command given" in out.stderr
    out = cli("run", "--env", "not a pair", "--", "true")
    assert out.returncode == 2 and "KEY=VALUE" in out.stderr


def test_help_names_exit_codes_and_the_label():
    out = cli("--help")
    assert out.returncode == 0 and "124" in out.stdout and "125" in out.stdout
    assert rdma_vm.LABEL_TCG == "Soft-RoCE (rxe) in a TCG VM: verbs semantics, not RDMA performance"


def test_status_says_why():
    out = cli("status")
    problem = rdma_vm.host_problem()
    assert out.returncode == (1 if problem else 0)
    assert (problem or "can run here") in out.stdout


def test_job_script_quotes_arguments_and_passes_selected_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("EASYPYVERBS_PROVIDER", "pyverbs")
    monkeypatch.setenv("UNRELATED_SECRET", "x")
    env = rdma_vm._guest_env({"EXTRA": "a b"}, "tcg")
    assert env["EASYPYVERBS_PROVIDER"] == "pyverbs" and env["FATE_RDMA_VM"] == "tcg" and "UNRELATED_SECRET" not in env
    argv = ["python", "-c", "print(\"it's\")", "$HOME"]
    rdma_vm._write_job(tmp_path, argv, "/some dir", env)
    script = (tmp_path / "cmd.sh").read_text()
    assert "cd '/some dir'" in script and "export EXTRA='a b'" in script
    out = subprocess.run(["sh", "-n", str(tmp_path / "cmd.sh")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert shlex.split(script.rstrip().splitlines()[-1]) == ["exec", *argv]


def test_run_refuses_an_empty_command():
    with pytest.raises(ValueError):
        rdma_vm.run([])
