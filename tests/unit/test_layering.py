"""docs/architecture.md §2-§3: the arrows between the parts of src/mmserve, read from the code's imports
(at module level, inside functions and under TYPE_CHECKING alike):
- core/ is pure Python (no torch, no runner/engine/models/entrypoints), so it is tested with fake
  runner outputs; inputs/ holds no engine state;
- families are plug-ins: only models/registry.py names a family's folder, no family imports another,
  and nothing under models/ imports the runner or the engine;
- the runner takes from core/ only the step contract; workers hold no request state; the entry points
  reach the engine, never the runner;
- the leaves (errors, envs, faults, hub, tracing) import nothing of mmserve but other leaves;
- the OpenAI server talks to one EngineClient: entrypoints/openai/ imports neither the Engine
  (engine/llm_engine.py) nor anything of cluster/ (cli.py and llm.py compose, and may);
- cluster/ imports nothing of workers/ (both use the child-process supervisor, which knows neither);
- tests/ and benchmarks/ import nothing of each other (they share testkit/); scripts/ take from tests/
  only public names;
- src/mmserve has no import cycle, counting module-level, in-function and TYPE_CHECKING imports alike.
Each rule is also run on a planted violation, so a rule that could never fail would show."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "mmserve"


def _module_name(path: Path, root: Path = SRC) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _statements(path: Path, root: Path = SRC) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(module, names) of every import statement in `path`: `import a.b` is ("a.b", ()), `from a import b, c`
    is ("a", ("b", "c")); relative imports are resolved against the file's package under `root`."""
    if path.is_relative_to(root):
        package = tuple(_module_name(path, root).split(".")[:None if path.name == "__init__.py" else -1])
    else:
        package = ()  # a probe outside `root`: its absolute imports only
    return _resolved_statements(path.read_text(), package)


@functools.cache  # every rule reads the same few hundred files: each is parsed once (keyed by its text)
def _resolved_statements(source: str, package: tuple[str, ...]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend((a.name, ()) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1], *([base] if base else [])])
            out.append((base, tuple(a.name for a in node.names)))
    return tuple(out)


def _imports(path: Path, root: Path = SRC) -> set[str]:
    """Every module name an import in `path` may name (for `from a import b`: `a` and `a.b`)."""
    return {n for base, names in _statements(path, root) for n in (base, *(f"{base}.{x}" for x in names))}


def _paths(*folders: str) -> list[Path]:
    """The modules under these folders of src/mmserve (a folder that is gone fails here, not silently)."""
    missing = [f for f in folders if not (SRC / f).is_dir()]
    assert not missing, f"src/mmserve has no {missing}: the layering rules name folders that moved"
    return sorted(p for folder in folders for p in (SRC / folder).rglob("*.py"))


def _ids(path: Path) -> str:
    return str(path.relative_to(SRC))


# ---- the rules, each a function of a file's imports ------------------------------------------------
def _core_violations(names: Iterable[str]) -> set[str]:
    return {n for n in names if n.split(".")[0] == "torch"
            or n.startswith(("mmserve.runner", "mmserve.engine", "mmserve.models", "mmserve.entrypoints"))}


FAMILY_DIRS = sorted(p.name for p in (SRC / "models").iterdir()
                     if p.is_dir() and p.name not in ("layers", "vision", "__pycache__"))


def _family_of(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if parts[:2] == ["mmserve", "models"] and len(parts) > 2 and parts[2] in FAMILY_DIRS else None


def _foreign_families(names: Iterable[str], own: str | None) -> set[str]:
    """The families named other than `own` (None: the file belongs to no family)."""
    return {n for n in names if _family_of(n) is not None and _family_of(n) != own}


def _own_family(path: Path) -> str | None:
    return _family_of(_module_name(path))


def _reaching(names: Iterable[str], *prefixes: str) -> set[str]:
    return {n for n in names if n.startswith(prefixes)}


# folder -> the parts of mmserve it may not import (models, inputs and workers: at any depth)
FORBIDDEN = {
    "inputs": ("mmserve.core", "mmserve.runner", "mmserve.engine"),
    "models": ("mmserve.runner", "mmserve.engine", "mmserve.workers", "mmserve.entrypoints"),
    "workers": ("mmserve.core", "mmserve.engine", "mmserve.entrypoints"),
    "entrypoints": ("mmserve.runner", "mmserve.workers", "mmserve.core"),
    "supervisor": ("mmserve.core", "mmserve.runner", "mmserve.engine", "mmserve.entrypoints", "mmserve.cluster",
                   "mmserve.workers"),
}


def _runner_core_violations(names: Iterable[str]) -> set[str]:
    """What the runner takes from core/ besides the step contract."""
    return {n for n in _reaching(names, "mmserve.core")
            if n not in ("mmserve.core", "mmserve.core.step") and not n.startswith("mmserve.core.step.")}


@functools.cache
def _src_graph() -> dict[str, set[str]]:
    return import_graph(SRC)


def _reached(path: Path) -> set[str]:
    """The modules of src/mmserve that importing `path` runs, at any depth."""
    return _reached_in(_src_graph(), _module_name(path))


def _reached_in(graph: dict[str, set[str]], module: str) -> set[str]:
    seen: set[str] = set()
    todo = [module]
    while todo:
        for target in graph[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def _imports_torch(module: str) -> bool:
    path = SRC.parent / (module.replace(".", "/") + ".py")
    path = path if path.is_file() else path.with_suffix("") / "__init__.py"
    return any(n.split(".")[0] == "torch" for n in _imports(path))


# the router and what it reads are tested with fake replicas, as core is with fake runner outputs
TORCH_FREE_CLUSTER = ("router.py", "keys.py", "protocol.py")


@pytest.mark.parametrize("path", _paths("core") + [SRC / "cluster" / name for name in TORCH_FREE_CLUSTER], ids=_ids)
def test_core_imports_no_torch_and_no_runner(path):
    """Directly or through anything it imports (core/, and the router's modules in cluster/)."""
    reached = _reached(path)
    bad = _core_violations(_imports(path) | reached) | {f"{m} (imports torch)" for m in reached if _imports_torch(m)}
    assert not bad, f"{_ids(path)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _paths("inputs"), ids=_ids)
def test_inputs_know_no_engine(path):
    bad = _reaching(_imports(path) | _reached(path), *FORBIDDEN["inputs"])
    assert not bad, f"{_ids(path)} imports {sorted(bad)}"


def test_family_folders_are_found():
    assert {"qwen2_vl", "qwen3_vl", "llava_onevision", "gemma3", "mistral3"} <= set(FAMILY_DIRS)


@pytest.mark.parametrize("path", [p for p in sorted(SRC.rglob("*.py")) if p != SRC / "models" / "registry.py"],
                         ids=_ids)
def test_only_the_registry_knows_families_and_no_family_imports_another(path):
    """Families are plug-ins: the engine, runner, core, server, inputs and the shared model code read a
    FamilySpec; only models/registry.py names a family's folder, and a family names only its own."""
    bad = _foreign_families(_imports(path), _own_family(path))
    assert not bad, f"{_ids(path)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _paths("models"), ids=_ids)
def test_models_import_neither_the_runner_nor_the_engine(path):
    """Directly or through anything they import."""
    bad = _reaching(_imports(path) | _reached(path), *FORBIDDEN["models"])
    assert not bad, f"{_ids(path)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _paths("runner"), ids=_ids)
def test_runner_takes_from_core_only_the_step_contract(path):
    bad = _runner_core_violations(_imports(path))
    assert not bad, f"{_ids(path)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", _paths("workers"), ids=_ids)
def test_workers_hold_no_request_state(path):
    """Encoder workers see items only: nothing from the scheduler, the engine or the server, at any depth."""
    bad = _reaching(_imports(path) | _reached(path), *FORBIDDEN["workers"])
    assert not bad, f"{_ids(path)} imports {sorted(bad)}"


def test_tracing_is_a_leaf():
    """The engine, the server and the replicas all write spans through it: it imports nothing of mmserve
    (engine/timeline.py takes `SpanRecord` from it, not the other way round)."""
    bad = {name for name in _imports(SRC / "tracing.py") if name.split(".")[0] == "mmserve"}
    assert not bad, f"tracing.py imports {sorted(bad)}"


@pytest.mark.parametrize("path", _paths("entrypoints"), ids=_ids)
def test_entrypoints_reach_the_engine_never_the_runner(path):
    bad = _reaching(_imports(path), *FORBIDDEN["entrypoints"])
    assert not bad, f"{_ids(path)} imports {sorted(bad)}"


# ---- leaves stay leaves --------------------------------------------------------------------------
# importable from anywhere (a worker process, the router, a test) without dragging the engine in
LEAVES = tuple(f"mmserve.{name}" for name in ("errors", "envs", "faults", "hub", "tracing"))


def _leaf_violations(graph: dict[str, set[str]], module: str) -> set[str]:
    """What importing the leaf `module` runs of its package besides other leaves (`mmserve` itself, whose
    __init__ holds the offline API, included; the parent package of a submodule import is not counted)."""
    return {m for m in _reached_in(graph, module) if m not in LEAVES}


@pytest.mark.parametrize("module", LEAVES)
def test_leaves_import_nothing_above_them(module):
    graph = _src_graph()
    bad = _leaf_violations(graph, module)
    culprits = sorted(m for m in graph[module] if m not in LEAVES or _leaf_violations(graph, m))
    assert not bad, f"{module} is a leaf but imports {culprits}, reaching {len(bad)} modules: {sorted(bad)[:8]}"


# ---- the server talks to an EngineClient; the cluster keeps to its side --------------------------
SERVER_FORBIDDEN = ("mmserve.engine.llm_engine", "mmserve.cluster")  # cli.py composes the client it gets
CLUSTER_FORBIDDEN = ("mmserve.workers",)  # replicas and encoder workers share the supervisor, not each other


def _within(names: Iterable[str], *packages: str) -> set[str]:
    """The names that are one of `packages` or lie inside one."""
    return {n for n in names if any(n == p or n.startswith(p + ".") for p in packages)}


@pytest.mark.parametrize("path", _paths("entrypoints/openai"), ids=_ids)
def test_the_server_knows_neither_the_engine_class_nor_the_cluster(path):
    """The server holds one EngineClient (engine/client.py), one engine or many alike."""
    bad = _within(_imports(path), *SERVER_FORBIDDEN)
    assert not bad, f"{_ids(path)} imports {sorted(bad)}: talk to the EngineClient the CLI hands over"


@pytest.mark.parametrize("path", _paths("cluster"), ids=_ids)
def test_the_cluster_imports_nothing_of_the_workers(path):
    bad = _within(_imports(path), *CLUSTER_FORBIDDEN)
    assert not bad, f"{_ids(path)} imports {sorted(bad)}: start children through the supervisor"


# supervisor/ (the child processes and actors of workers/ and cluster/ alike) lands with structure step 2's
# cluster branch: until then this rule has no module to check
@pytest.mark.parametrize("path", sorted((SRC / "supervisor").rglob("*.py")), ids=_ids)
def test_the_supervisor_knows_nothing_of_what_its_children_run(path):
    """Directly or through anything it imports."""
    bad = _reaching(_imports(path) | _reached(path), *FORBIDDEN["supervisor"])
    assert not bad, f"{_ids(path)} imports {sorted(bad)}"


def test_the_new_rules_catch_planted_violations(tmp_path):
    package = tmp_path / "mmserve"
    (package / "engine").mkdir(parents=True)
    for name in ("__init__.py", "engine/__init__.py", "engine/timeline.py", "errors.py"):
        (package / name).write_text("")
    (package / "envs.py").write_text("from mmserve import errors\n")
    (package / "hub.py").write_text("from mmserve import envs\nfrom mmserve.errors import ModelLoadError\n")
    (package / "tracing.py").write_text("def later():\n    from mmserve.engine.timeline import SpanRecord\n")
    (package / "faults.py").write_text("from mmserve.hub import resolve\n")
    graph = import_graph(package)
    assert not _leaf_violations(graph, "mmserve.hub")  # a leaf may import other leaves
    assert _leaf_violations(graph, "mmserve.tracing") == {"mmserve.engine.timeline"}  # lazily, too
    (package / "errors.py").write_text("import mmserve\n")  # the package's __init__: the whole API
    assert _leaf_violations(import_graph(package), "mmserve.faults") == {"mmserve"}
    server = _planted(tmp_path, "from mmserve.engine.llm_engine import Engine\n"
                                "def f():\n    from mmserve.cluster import replicas\n"
                                "from mmserve.engine.client import EngineClient\n")
    assert _within(server, *SERVER_FORBIDDEN) == {"mmserve.engine.llm_engine", "mmserve.engine.llm_engine.Engine",
                                                  "mmserve.cluster", "mmserve.cluster.replicas"}
    assert _within(_planted(tmp_path, "from mmserve.workers.ray_pool import init_ray\n"), *CLUSTER_FORBIDDEN)
    assert not _within(_planted(tmp_path, "import mmserve.workersupervisor\n"), *CLUSTER_FORBIDDEN)


# ---- no import cycle -----------------------------------------------------------------------------
def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package tree it imports: `from pkg import mod` names `mod` (not
    `pkg`, whose __init__ runs as the parent of anything imported: that is no dependency on it);
    `from pkg import Name` names `pkg`."""
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for base, names in _statements(path, root):
            submodules = {f"{base}.{x}" for x in names} & modules.keys()
            targets |= submodules
            if len(submodules) < len(names) or not names:  # a name defined in `base` itself, or `import base`
                targets |= {base} & modules.keys()
        graph[name] = targets - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_src_has_no_import_cycle():
    cycles = import_cycles(import_graph(SRC))
    assert not cycles, f"import cycles (module level and lazy imports both count): {cycles}"


# ---- each rule fails on a planted violation ------------------------------------------------------
def _planted(tmp_path: Path, source: str) -> set[str]:
    probe = tmp_path / "probe.py"
    probe.write_text(source)
    return _imports(probe, tmp_path)


def test_the_rules_catch_planted_violations(tmp_path):
    lazy_family = _planted(tmp_path, "def f():\n    from mmserve.models.qwen2_vl.processor import Qwen2VLProcessor\n")
    assert "mmserve.models.qwen2_vl.processor" in _foreign_families(lazy_family, None)
    # a family reaching into another one, by module or by name from its package
    assert _foreign_families(_planted(tmp_path, "from mmserve.models.qwen2_vl import vision\n"), "qwen3_vl") \
        == {"mmserve.models.qwen2_vl", "mmserve.models.qwen2_vl.vision"}
    assert not _foreign_families(_planted(tmp_path, "from mmserve.models.qwen3_vl.config import TextConfig\n"),
                                 "qwen3_vl")
    typing_only = _planted(tmp_path, "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                     "    from mmserve.runner.graphs.buckets import EncoderBucket\n")
    assert _reaching(typing_only, "mmserve.runner")  # models -> runner, even for types
    assert _reaching(_planted(tmp_path, "from mmserve.runner import model_runner\n"), "mmserve.runner")
    assert _core_violations(_planted(tmp_path, "import torch.nn\n")) == {"torch.nn"}
    assert _core_violations(_planted(tmp_path, "def f():\n    from mmserve.engine import llm_engine\n"))
    for folder, prefixes in FORBIDDEN.items():
        for prefix in prefixes:
            assert _reaching(_planted(tmp_path, f"from {prefix}.some_module import Thing\n"), *prefixes), folder
    assert _runner_core_violations(_planted(tmp_path, "from mmserve.core.scheduler import Scheduler\n"))
    assert not _runner_core_violations(_planted(tmp_path, "from mmserve.core.step import SchedulerOutput\n"))


def test_the_cycle_check_catches_a_lazy_cycle(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for init in (package / "__init__.py", package / "sub" / "__init__.py"):
        init.write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def later():\n    from pkg import c\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n")
    (package / "d.py").write_text("import pkg.a\n")
    assert import_cycles(import_graph(package)) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    (package / "c.py").write_text("")
    assert import_cycles(import_graph(package)) == []
    # through a package's own __init__: `from pkg import Name` depends on pkg/__init__.py
    (package / "__init__.py").write_text("from pkg.d import Thing\n")
    (package / "d.py").write_text("from pkg import helper\nThing = 1\n")
    assert import_cycles(import_graph(package)) == [["pkg", "pkg.d"]]


# ---- tests and benchmarks import nothing of each other ------------------------------------------
ROOT = SRC.parents[1]


def _tree_imports(folder: str) -> dict[Path, set[str]]:
    """Every module file under ROOT/folder -> the module names its imports may name (relative imports
    resolved inside that tree)."""
    root = ROOT / folder
    return {path: _imports(path, root) for path in sorted(root.rglob("*.py"))}


def _crossing(names: Iterable[str], other: str) -> set[str]:
    return {n for n in names if n.split(".")[0] == other}


@pytest.mark.parametrize("mine, other", [("tests", "benchmarks"), ("benchmarks", "tests")])
def test_tests_and_benchmarks_import_nothing_of_each_other(mine, other):
    """What both need (tiny checkpoints, workloads, simulators' logic) lives in testkit/ or src/."""
    bad = {str(path.relative_to(ROOT)): sorted(_crossing(names, other))
           for path, names in _tree_imports(mine).items() if _crossing(names, other)}
    assert not bad, f"{mine}/ imports {other}/: {bad}"


def _private_reaches(path: Path, other: str) -> set[str]:
    """What `path` takes from the top-level package `other` that is private: a `_name`, or a test module."""
    bad = set()
    for base, names in _statements(path, ROOT):
        if base.split(".")[0] != other:
            continue
        parts = base.split(".")
        if any(p.startswith("_") or p.startswith("test_") for p in parts[1:]):
            bad.add(base)
        bad |= {f"{base}.{n}" for n in names if n.startswith("_") or n.startswith("test_")}
    return bad


@pytest.mark.parametrize("path", sorted((ROOT / "scripts").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_scripts_take_from_tests_only_public_fixtures(path):
    bad = _private_reaches(path, "tests")
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: share it through testkit/"


def test_the_sharing_rules_catch_planted_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from tests.models.test_engine_parity import _workload\nfrom benchmarks.offline import _greedy\n"
                     "def later():\n    import benchmarks.soak\n")
    assert _private_reaches(probe, "tests") == {"tests.models.test_engine_parity",
                                                "tests.models.test_engine_parity._workload"}
    assert _private_reaches(probe, "benchmarks") == {"benchmarks.offline._greedy"}
    names = _imports(probe, tmp_path)
    assert _crossing(names, "benchmarks") == {"benchmarks.offline", "benchmarks.offline._greedy", "benchmarks.soak"}
    assert _crossing(names, "tests") == {"tests.models.test_engine_parity", "tests.models.test_engine_parity._workload"}
    assert not _crossing({"testkit.families", "benchmarks_extra.run"}, "benchmarks")  # the shared kit, a lookalike


# ---- the engine talks to the runner through its methods ------------------------------------------
def _runner_methods() -> set[str]:
    tree = ast.parse((SRC / "runner" / "model_runner.py").read_text())
    runner = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelRunner")
    return {n.name for n in runner.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}


def _runner_uses(source: str) -> set[str]:
    """The names taken off `<anything>.runner` in `source`."""
    return {node.attr for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "runner"}


@pytest.mark.parametrize("path", _paths("engine", "entrypoints"), ids=_ids)
def test_the_engine_uses_only_the_runners_methods(path):
    """Never its attributes (`runner.encoder.store`, `runner.async_encoder.jobs`, ...): the seam stays typed."""
    bad = _runner_uses(path.read_text()) - _runner_methods()
    assert not bad, f"{_ids(path)} reaches into the runner for {sorted(bad)}"


def test_the_seam_check_catches_an_attribute():
    assert {"execute", "release", "take_outcomes"} <= _runner_methods()
    assert _runner_uses("self.runner.encoder.store.clear()\nself.runner.release('r')\n") - _runner_methods() \
        == {"encoder"}


# ---- the engine talks to the scheduler through its methods ---------------------------------------
def _scheduler_methods() -> set[str]:
    """The scheduler's public methods; a property is read like an attribute and does not count."""
    methods = set()
    for module, name in (("scheduler.py", "Scheduler"), ("scheduler_views.py", "SchedulerViews"),
                         ("scheduler_handoff.py", "HandOffCalls")):  # with its mixins
        tree = ast.parse((SRC / "core" / module).read_text())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
        methods |= {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")
                    and not any(isinstance(d, ast.Name) and d.id == "property" for d in n.decorator_list)}
    return methods


def _scheduler_uses(source: str) -> set[str]:
    """The names taken off `self.scheduler` or a variable `scheduler` in `source` (not `config.scheduler`:
    the scheduler's settings)."""
    def is_scheduler(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id == "scheduler") or (
            isinstance(node, ast.Attribute) and node.attr == "scheduler" and isinstance(node.value, ast.Name)
            and node.value.id == "self")
    return {node.attr for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)
            and is_scheduler(node.value)}


def _scheduler_calls(source: str) -> set[str]:
    """The names taken off the scheduler that are called there and then, or handed on as bound methods."""
    tree = ast.parse(source)
    called = {node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Attribute)}
    passed = {arg.attr for node in ast.walk(tree) if isinstance(node, ast.Call) for arg in node.args
              if isinstance(arg, ast.Attribute)}
    return called | passed


@pytest.mark.parametrize("path", _paths("engine", "entrypoints"), ids=_ids)
def test_the_engine_uses_only_the_schedulers_methods(path):
    """Never its attributes (`scheduler.kv.block_ids`, `scheduler.running`, `scheduler.encoder_cache.entries`,
    ...): what the engine reads of core/ comes through methods and frozen snapshots (core/snapshots.py)."""
    source = path.read_text()
    uses = _scheduler_uses(source)
    bad = (uses - _scheduler_methods()) | (uses - _scheduler_calls(source))
    assert not bad, f"{_ids(path)} reaches into the scheduler for {sorted(bad)}"


def test_the_scheduler_seam_check_catches_an_attribute():
    assert {"schedule", "update", "snapshot", "finish_requests"} <= _scheduler_methods()
    assert "num_unfinished" not in _scheduler_methods()  # a property
    source = "self.scheduler.kv.block_ids('r')\nn = len(self.scheduler.running)\nself.scheduler.schedule()\n" \
             "x = self.scheduler.num_unfinished\nconfig.scheduler.max_num_seqs\n"
    uses = _scheduler_uses(source)
    assert uses == {"kv", "running", "schedule", "num_unfinished"}
    assert (uses - _scheduler_methods()) | (uses - _scheduler_calls(source)) == {"kv", "running", "num_unfinished"}
