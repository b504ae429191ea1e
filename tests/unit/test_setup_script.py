"""scripts/setup.sh and run.sh without installing anything: which torch build the set-up picks (an
`nvidia-smi` faked on PATH stands for the GPU), the commands `--dry-run` prints, the stamp that tells a CPU
venv from a CUDA one, argument handling when sourced, and scripts/pip_sources.py's translation of pip's
configuration into uv flags."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIST_GPU = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0b5f2c1e-0000-0000-0000-000000000000)"


def _fake_nvidia_smi(folder: Path, cuda_version: str | None) -> None:
    """An `nvidia-smi` listing one GPU whose driver supports `cuda_version`, or (None) one that finds none."""
    folder.mkdir(exist_ok=True)
    if cuda_version is None:
        body = 'echo "No devices were found"; exit 6'
    else:
        body = (f'if [ "${{1:-}}" = -L ]; then echo "{LIST_GPU}"; else echo "| NVIDIA-SMI 580.65.06   '
                f'Driver Version: 580.65.06   CUDA Version: {cuda_version}     |"; fi')
    tool = folder / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\n{body}\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A copy of what setup.sh reads (itself, pip_sources.py, pyproject.toml): a dry run there cannot
    touch the checkout, and whether it created anything can be seen."""
    (tmp_path / "scripts").mkdir()
    for name in ("scripts/setup.sh", "scripts/pip_sources.py", "scripts/run.sh", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def _setup(repo: Path, *args: str, gpu: str | None = None, **env: str) -> subprocess.CompletedProcess:
    fake = repo.parent / f"fake-bin-{gpu}"
    _fake_nvidia_smi(fake, gpu)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MMSERVE_")}
    full_env.update(PATH=f"{fake}{os.pathsep}{os.environ['PATH']}", PYTHON=sys.executable, **env)
    return subprocess.run(["bash", str(repo / "scripts" / "setup.sh"), *args], capture_output=True, text=True,
                          env=full_env, timeout=60)


def _install_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if " pip install " in line and "-e" in line.split()]
    assert len(lines) == 1, result.stdout
    return lines[0]


def test_cuda_dry_run_prints_a_cuda_install_and_changes_nothing(repo):
    result = _setup(repo, "--cuda", "--dry-run")
    line = _install_line(result)
    assert "torch==2.13.0+cu128" in line and "https://download.pytorch.org/whl/cu128" in line, line
    assert "-m venv .venv" in result.stdout
    assert sorted(p.name for p in repo.iterdir()) == ["pyproject.toml", "scripts"]  # no .venv, no stamp


def test_the_checkouts_own_cuda_dry_run_exits_0():
    """What the docs run: in the checkout itself, whatever its .venv holds."""
    result = subprocess.run(["bash", "scripts/setup.sh", "--cuda", "--dry-run"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "download.pytorch.org/whl/cu" in result.stdout


@pytest.mark.parametrize(("driver_cuda", "build"), [("13.0", "cu130"), ("12.8", "cu128"), ("12.4", "cu126")])
def test_a_listed_gpu_gets_the_cuda_build_its_driver_runs(repo, driver_cuda, build):
    line = _install_line(_setup(repo, "--dry-run", gpu=driver_cuda))
    assert f"torch==2.13.0+{build}" in line and f"https://download.pytorch.org/whl/{build}" in line, line


def test_no_gpu_or_cpu_asked_for_gets_the_cpu_build(repo):
    for result in (_setup(repo, "--dry-run"), _setup(repo, "--cpu", "--dry-run", gpu="13.0")):
        line = _install_line(result)
        assert "torch==2.13.0+cpu" in line and "whl/cu" not in line, line


def test_the_cuda_version_can_be_named(repo):
    line = _install_line(_setup(repo, "--cuda", "--dry-run", MMSERVE_TORCH_CUDA="cu126"))
    assert "torch==2.13.0+cu126" in line, line


def _stamp(repo: Path, *args: str, **env: str) -> str:
    """The stamp line a set-up with these arguments would write (from its dry run)."""
    result = _setup(repo, *args, "--dry-run", **env)
    return result.stderr.split("stamp: ", 1)[1].splitlines()[0]


def _up_to_date(repo: Path, *args: str, gpu: str | None = None, **env: str) -> bool:
    result = _setup(repo, *args, "--dry-run", gpu=gpu, **env)
    assert result.returncode == 0, result.stderr
    return "is up to date" in result.stderr


def test_the_stamp_tells_a_cpu_venv_from_a_cuda_one(repo):
    (repo / ".venv").mkdir()
    (repo / ".venv" / ".mmserve-installed").write_text(_stamp(repo, "--cpu", MMSERVE_EXTRAS="client") + "\n")
    assert _up_to_date(repo, "--cpu", MMSERVE_EXTRAS="client")
    assert _up_to_date(repo, MMSERVE_EXTRAS="client")  # no GPU: the CPU venv is the one wanted
    assert not _up_to_date(repo, "--cuda", MMSERVE_EXTRAS="client")
    assert not _up_to_date(repo, gpu="12.8", MMSERVE_EXTRAS="client")  # a GPU now: CUDA torch wanted
    assert not _up_to_date(repo, "--cpu", MMSERVE_EXTRAS="test")  # an extra not installed
    (repo / ".venv" / ".mmserve-installed").write_text(_stamp(repo, "--cuda", MMSERVE_EXTRAS="test,client") + "\n")
    assert _up_to_date(repo, "--cuda", MMSERVE_EXTRAS="client")  # the test venv also runs
    assert not _up_to_date(repo, "--cpu", MMSERVE_EXTRAS="client")


def test_sourced_it_ignores_the_callers_arguments(repo):
    """run.sh's own arguments (`--no-serve --port 9000`) are the positional parameters of a sourced script."""
    script = 'set -- --no-serve --port 9000 --cpu; MMSERVE_SETUP_DRY_RUN=1 MMSERVE_TORCH=cuda source scripts/setup.sh'
    result = subprocess.run(["bash", "-c", script], cwd=repo, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, result.stderr
    assert "torch==2.13.0+cu" in _install_line(result)  # MMSERVE_TORCH, not the caller's --cpu


def test_unknown_arguments_are_refused(repo):
    result = _setup(repo, "--gpu")
    assert result.returncode == 2 and "unknown argument --gpu" in result.stderr


def test_pip_can_be_kept_to(repo):
    line = _install_line(_setup(repo, "--cpu", "--dry-run", MMSERVE_INSTALLER="pip"))
    assert line.startswith(".venv/bin/python -m pip install --no-compile"), line


def test_run_sh_documents_host_and_port_and_refuses_what_it_does_not_know(repo):
    shown = subprocess.run(["bash", str(repo / "scripts" / "run.sh"), "--help"], capture_output=True, text=True)
    assert shown.returncode == 0 and "--host HOST" in shown.stdout and "--port PORT" in shown.stdout
    assert not (repo / ".venv").exists()  # --help sets nothing up
    refused = subprocess.run(["bash", str(repo / "scripts" / "run.sh"), "--prot", "9000"], capture_output=True,
                             text=True)
    assert refused.returncode == 2 and "unknown option --prot" in refused.stderr


def test_pip_sources_become_uv_flags(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": str(wheels),
           "PIP_EXTRA_INDEX_URL": "file:///a/simple file:///b/simple", "PIP_CONSTRAINT": "/etc/c.txt"}
    script = str(ROOT / "scripts" / "pip_sources.py")
    def lines(*args: str) -> list[str]:
        return subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=env).stdout.split()

    flags = lines()
    assert flags[:2] == ["--index-strategy", "unsafe-best-match"]
    pairs = list(zip(flags[2::2], flags[3::2]))
    assert ("--find-links", str(wheels)) in pairs and ("--constraint", "/etc/c.txt") in pairs
    assert ("--extra-index-url", "file:///a/simple") in pairs and ("--extra-index-url", "file:///b/simple") in pairs
    assert lines("--has-wheel", "torch-2.13.0+cpu-*.whl")[-2:] == ["has-wheel:", "yes"]
    assert lines("--has-wheel", "torch-2.13.0+cu128-*.whl")[-2:] == ["has-wheel:", "no"]
