"""The wheel as a user installs it: built from this checkout, it holds every kernel source and header, and
installed into a fresh venv (no editable mmserve in sight) it answers the demo model's question with the
native kernels built from its own sources, not their fallbacks."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest
from PIL import Image

from mmserve.runner.cpu import gemm, native

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "src" / "mmserve" / "runner" / "cpu" / "kernels"
# the kernels every demo answer asks for on a CPU that runs them (float32 matmuls, paged attention), and
# the two that include amx_tiles.h (asked for where the CPU has bfloat16 arithmetic, or always: quant_gemm)
DEMO_KERNELS = {"panel_gemm.cpp", "paged_attention.cpp"}

# runs the demo through the CLI's own entry (`mmserve generate`), then says where mmserve came from and
# which kernels this process built
DRIVER = textwrap.dedent("""
    import json, sys
    import mmserve
    from mmserve.entrypoints.cli import main
    from mmserve.runner.cpu import native
    code = main(["generate", "--image", sys.argv[1], "--prompt", "What shape is the red one?", "--max-tokens", "8"])
    print(json.dumps({"code": code, "mmserve": mmserve.__file__,
                      "kernels": {k: v and str(v) for k, v in native.built_kernels().items()}}))
""")


def _run(*args: str | Path, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=900, **kwargs)
    assert result.returncode == 0, f"{args}: {result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # from a copy of what the build reads: a build in the checkout would leave build/ and *.egg-info there,
    # and files a stale build/ still holds would go into the wheel whatever package-data says
    source = out / "source"
    for name in ("pyproject.toml", "README.md"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    # no build isolation: setuptools is in the test venv already, and an isolated build would reach an index
    _run(sys.executable, "-m", "pip", "wheel", source, "--no-deps", "--no-build-isolation", "-w", out, cwd=out)
    (built,) = out.glob("mmserve-*.whl")
    return built


@pytest.mark.slow
@pytest.mark.kernels
def test_the_wheel_holds_every_kernel_source_and_header(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "mmserve/runner/cpu/kernels/amx_tiles.h" in names
    for source in KERNELS.iterdir():
        assert f"mmserve/runner/cpu/kernels/{source.name}" in names, source.name
    assert "mmserve/assets/demo-model/model.safetensors" in names


@pytest.mark.slow
@pytest.mark.kernels
def test_the_installed_wheel_answers_with_the_native_kernels(wheel, tmp_path):
    if gemm.kernel() is None:  # this machine's checkout itself falls back (no compiler, no AVX2, switched off)
        pytest.skip(f"mmserve's native kernels do not run here: {native.built_kernels()}")
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    fresh_python = venv / "bin" / "python"
    _run(sys.executable, "-m", "pip", "--python", fresh_python, "install", "--no-deps", "--no-compile", wheel)
    fresh_site = Path(_run(fresh_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
                      .stdout.strip())
    # the test venv's packages (torch and the rest) after the fresh venv's own: a folder named in a .pth
    # is put on sys.path, but the .pth files in it (the editable mmserve's) are not read
    (fresh_site / "test-venv-packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    image = tmp_path / "red.png"
    Image.new("RGB", (64, 48), (220, 20, 20)).save(image)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "MMSERVE_COMPILE_CPU_DECODE": "0",
           "MMSERVE_CACHE_DIR": str(tmp_path / "cache")}  # built here, from the wheel's own sources
    run = _run(fresh_python, "-c", DRIVER, image, env=env, cwd=tmp_path)
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["code"] == 0, run.stderr
    assert Path(report["mmserve"]).is_relative_to(fresh_site), report  # the wheel's mmserve, not the checkout's
    kernels = report["kernels"]
    assert DEMO_KERNELS <= set(kernels), kernels
    fell_back = [name for name, library in kernels.items() if library is None]
    assert not fell_back, f"fell back from {fell_back}: {run.stderr[-3000:]}"
    assert not re.search(r"building \S+ failed", run.stderr), run.stderr
