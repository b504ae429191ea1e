"""House style, measured: every module of src/mmserve has at most 400 lines and every function at most 60
(from its `def` line to its last line, docstring and nested functions included). A module grows by
adding a small policy object beside it, not by adding branches to one loop.

What may exceed a limit is listed below, each with why; the lists only shrink. Each check is also run
on a planted oversize module and function, so a check that could never fail would show."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "mmserve"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60

# module path under src/mmserve -> why it may be longer (empty: keep it so)
MODULES_ALLOWED_LONGER: dict[str, str] = {}
# "module path:qualified function name" -> why it may be longer (empty: keep it so)
FUNCTIONS_ALLOWED_LONGER: dict[str, str] = {}


def module_lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """Qualified name (`Class.method`, `outer.inner`) -> lines, for every function longer than `limit`."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                lines = child.end_lineno - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and lines > limit:
                    found[name] = lines
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def oversize_modules(root: Path, allowed: dict[str, str]) -> dict[str, int]:
    """Module path under `root` -> lines, for each module over the limit and not allowed."""
    lines = {path.relative_to(root).as_posix(): module_lines(path) for path in sorted(root.rglob("*.py"))}
    return {key: n for key, n in lines.items() if n > MAX_MODULE_LINES and key not in allowed}


def oversize_functions(root: Path, allowed: dict[str, str]) -> dict[str, int]:
    """"module path:function" -> lines, for each function over the limit and not allowed."""
    found = {f"{path.relative_to(root).as_posix()}:{name}": n for path in sorted(root.rglob("*.py"))
             for name, n in long_functions(path.read_text()).items()}
    return {key: n for key, n in found.items() if key not in allowed}


def test_modules_stay_under_the_line_limit():
    bad = oversize_modules(SRC, MODULES_ALLOWED_LONGER)
    assert not bad, f"modules over {MAX_MODULE_LINES} lines (split a policy object out): {bad}"


def test_functions_stay_under_the_line_limit():
    bad = oversize_functions(SRC, FUNCTIONS_ALLOWED_LONGER)
    assert not bad, f"functions over {MAX_FUNCTION_LINES} lines: {bad}"


def test_the_allow_lists_name_only_what_still_exceeds():
    """An entry whose module or function shrank (or moved) is taken off, so the lists only shrink."""
    stale = (set(MODULES_ALLOWED_LONGER) - set(oversize_modules(SRC, {}))) | \
        (set(FUNCTIONS_ALLOWED_LONGER) - set(oversize_functions(SRC, {})))
    assert not stale, f"no longer over the limit (take them off the allow-list): {sorted(stale)}"


def test_the_checks_catch_a_planted_oversize_module_and_function(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "engine" / "short.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    assert oversize_modules(tmp_path, {}) == {"engine/long.py": MAX_MODULE_LINES + 1}
    assert oversize_modules(tmp_path, {"engine/long.py": "why"}) == {}

    def function(name: str, body_lines: int, indent: str = "") -> str:
        return f"{indent}def {name}():\n" + "".join(f"{indent}    x{i} = {i}\n" for i in range(body_lines))
    longest = MAX_FUNCTION_LINES - 1  # a def line and this many body lines: exactly at the limit
    source = "class Engine:\n" + function("step", longest + 1, "    ") + function("fits", longest, "    ")
    source += "async " + function("outer", 1) + function("inner", longest + 1, "    ")
    (tmp_path / "funcs.py").write_text(source)
    assert long_functions(source) == {"Engine.step": MAX_FUNCTION_LINES + 1, "outer": MAX_FUNCTION_LINES + 3,
                                      "outer.inner": MAX_FUNCTION_LINES + 1}
    assert oversize_functions(tmp_path, {"funcs.py:outer": "why"}) == {"funcs.py:Engine.step": MAX_FUNCTION_LINES + 1,
                                                                      "funcs.py:outer.inner": MAX_FUNCTION_LINES + 1}


MAX_ENGINE_METHODS = 20


def engine_methods(source: str) -> list[str]:
    """The `def`s in class Engine's body (properties included)."""
    engine = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef) and node.name == "Engine")
    return [node.name for node in engine.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_the_engine_keeps_the_step_loop_and_composition_only() -> None:
    """Output building, stats and assembly live beside the engine (output_processor.py, stats.py,
    assembly.py): Engine itself stays at most 20 methods."""
    methods = engine_methods((SRC / "engine" / "llm_engine.py").read_text())
    assert len(methods) <= MAX_ENGINE_METHODS, f"Engine has {len(methods)} methods: {methods}"
    planted = "class Engine:\n" + "".join(f"    def m{i}(self): pass\n" for i in range(MAX_ENGINE_METHODS + 1))
    assert len(engine_methods(planted)) > MAX_ENGINE_METHODS
