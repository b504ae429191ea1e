"""What a client script imports from mmserve loads no torch (nor the engine): each import runs in a fresh
interpreter and the test reads `sys.modules` afterwards, a check that does not depend on the machine's load.
The package's public names still import as before, loaded on first use (mmserve/__init__'s PEP 562 hook)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CLIENT_MODULES = ("mmserve", "mmserve.demo", "mmserve.demo.shapes", "mmserve.demo.video", "mmserve.errors",
                  "mmserve.envs")


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("module", CLIENT_MODULES)
def test_client_module_imports_no_torch(module: str) -> None:
    loaded = _run(f"import sys, {module}; print(sorted(m for m in ('torch', 'mmserve.engine', 'transformers') "
                  "if m in sys.modules))")
    assert loaded == "[]", f"importing {module} loaded {loaded}"


def test_public_names_load_on_first_use() -> None:
    out = _run("import sys, mmserve; before = 'torch' in sys.modules; "
               "from mmserve import InvalidInputError, SamplingParams, VideoFrames; "
               "from mmserve import LLM; "
               "print(before, LLM.__module__, SamplingParams.__name__, InvalidInputError.__module__, "
               "'LLM' in dir(mmserve), sorted(mmserve.__all__) == sorted(set(mmserve.__all__)))")
    assert out == "False mmserve.entrypoints.llm SamplingParams mmserve.errors True True"


def test_unknown_name_is_an_attribute_error() -> None:
    import mmserve

    with pytest.raises(AttributeError, match="no_such_name"):
        mmserve.no_such_name  # noqa: B018 (the lookup is the test)
