"""What a failed or ended C++ build leaves in Inductor's cache is removed (runner/cpu/compile.py), so no
later start loads half a library: the `-o` output of a compiler command that failed (inside Inductor's
wrapped exceptions), a cached library that failed to load; nothing outside the cache. A compiler ended
by a signal (Ctrl-C reaching it, a stopped compile) counts as interrupted, not as a failure of the code."""

import subprocess

import pytest
from torch._inductor.exc import CppCompileError, InductorError

from mmserve.envs import INDUCTOR_CACHE_DIR
from mmserve.runner.cpu.compile import compiler_interrupted, drop_failed_build_outputs


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(INDUCTOR_CACHE_DIR, str(tmp_path / "inductor"))
    (tmp_path / "inductor" / "jq").mkdir(parents=True)
    return tmp_path / "inductor"


def _failed_build(cmd: list[str], returncode: int) -> InductorError:
    """The exception chain Inductor raises for a compiler command that exited with `returncode`."""
    try:
        try:
            raise subprocess.CalledProcessError(returncode, cmd, output=b"")
        except subprocess.CalledProcessError as e:
            raise CppCompileError(cmd, "warnings only") from e
    except CppCompileError as e:
        return InductorError(e, None)


def test_the_output_of_a_compiler_ended_by_a_signal_is_removed(cache):
    library = cache / "jq" / "kernel.main.so"
    library.write_bytes(b"")  # what a linker ended mid-write left
    source = cache / "jq" / "kernel.main.cpp"
    source.write_text("int main;")
    error = _failed_build(["g++", str(source), "-shared", "-o", str(library), "-ltorch"], -2)
    assert compiler_interrupted(error)
    assert drop_failed_build_outputs(error) == [library.resolve()]
    assert not library.exists() and source.exists()


def test_a_real_compile_error_is_a_failure_and_its_output_goes_too(cache):
    library = cache / "jq" / "kernel.main.so"
    library.write_bytes(b"\x7fELF")
    error = _failed_build(["g++", "kernel.cpp", "-o", str(library)], 1)
    assert not compiler_interrupted(error)
    assert drop_failed_build_outputs(error) == [library.resolve()]


def test_a_cached_library_that_fails_to_load_is_removed(cache):
    library = cache / "jq" / "cjq27.main.so"
    library.write_bytes(b"")
    error = InductorError(ImportError(f"{library}: file too short"), None)
    assert not compiler_interrupted(error)
    assert drop_failed_build_outputs(error) == [library.resolve()]


def test_nothing_outside_the_cache_is_touched(cache, tmp_path):
    elsewhere = tmp_path / "mine.so"
    elsewhere.write_bytes(b"")
    assert drop_failed_build_outputs(_failed_build(["g++", "x.cpp", "-o", str(elsewhere)], -15)) == []
    assert drop_failed_build_outputs(ImportError(f"{elsewhere}: file too short")) == []
    assert drop_failed_build_outputs(RuntimeError("no build in it")) == []
    assert elsewhere.exists()
