"""The contributor's map and the README stay true to the code: docs/architecture.md §2 names every module of
src/mmserve under its own folder (by the tree's indentation: `config.py` at the top is not
`models/gemma3/config.py`), every module and folder the map names exists, and the README's architectures
table lists every architecture the registry serves.

How the map is read: in §2's code block, a line indented less than DESCRIPTION_COLUMN is an entry (two
spaces per level); an entry ending in `/` is a folder, whose description and the entries and
continuation lines under it (up to its next folder) belong to it; every bare `name.py` in a folder's text
is a module of that folder (a `folder/name.py` mention is a pointer elsewhere, not counted). `<family>/`
under models/ lists what every family folder holds; the folders under it are the families."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from mmserve.models.registry import supported_architectures

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "mmserve"
DESCRIPTION_COLUMN = 20  # entries sit at 2 spaces per level; descriptions continue at column 23
FAMILY_TEMPLATE = "<family>"
MODULE_NAME = re.compile(r"(?<![\w/.`-])([A-Za-z_]\w*\.py)\b")


@dataclass
class SourceMap:
    """What the map says: folder path under src/mmserve ("" for the top) -> the module names it lists."""

    modules: dict[str, set[str]] = field(default_factory=dict)
    families: set[str] = field(default_factory=set)  # the folders listed under models/<family>/

    def names(self, folder: str) -> set[str]:
        shared = self.modules.get(f"models/{FAMILY_TEMPLATE}", set()) if folder in self.families else set()
        return self.modules.get(folder, set()) | shared


def read_map(doc: str, top: str = "src/mmserve/") -> SourceMap:
    lines = doc.split("\n## 2.", 1)[1].split("```", 2)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == top)
    source_map = SourceMap(modules={"": set()})
    stack: list[tuple[int, str]] = [(0, "")]  # (indent, folder path) of the folders enclosing this line
    owner = ""
    for line in lines[start + 1:]:
        indent = len(line) - len(line.lstrip())
        if not line.strip():
            continue
        if indent == 0:
            break  # the next top-level tree (tests/, benchmarks/, ...)
        if indent < DESCRIPTION_COLUMN:
            entry, _, rest = line.strip().partition(" ")
            while stack[-1][0] >= indent:
                stack.pop()
            owner = stack[-1][1]
            if re.fullmatch(r"[\w<>-]+/", entry):
                owner = _folder_path(owner, entry[:-1], source_map)
                stack.append((indent, owner))
                source_map.modules.setdefault(owner, set())
                line = rest
        source_map.modules[owner] |= set(MODULE_NAME.findall(line))
    return source_map


def _folder_path(parent: str, name: str, source_map: SourceMap) -> str:
    if parent == f"models/{FAMILY_TEMPLATE}":  # a family: its own folder under models/
        source_map.families.add(f"models/{name}")
        return f"models/{name}"
    return f"{parent}/{name}".lstrip("/")


def unmapped_modules(source_map: SourceMap, src: Path = SRC) -> list[str]:
    def folder(path: Path) -> str:
        relative = path.parent.relative_to(src).as_posix()
        return "" if relative == "." else relative
    return [path.relative_to(src).as_posix() for path in sorted(src.rglob("*.py"))
            if path.name != "__init__.py" and path.name not in source_map.names(folder(path))]


def missing_paths(source_map: SourceMap, src: Path = SRC) -> list[str]:
    """What the map names that does not exist (a name listed under <family>/ must exist in some family)."""
    missing = [f"{folder}/" for folder in source_map.modules
               if FAMILY_TEMPLATE not in folder and not (src / folder).is_dir()]
    for folder, names in source_map.modules.items():
        places = sorted(source_map.families) if FAMILY_TEMPLATE in folder else [folder]
        missing += [f"{folder}/{name}".lstrip("/") for name in sorted(names)
                    if not any((src / place / name).is_file() for place in places)]
    return missing


def test_the_architecture_map_names_every_module_under_its_folder():
    unnamed = unmapped_modules(read_map((ROOT / "docs" / "architecture.md").read_text()))
    assert not unnamed, f"docs/architecture.md §2 does not name {unnamed} under its folder"


def test_every_path_the_architecture_map_names_exists():
    missing = missing_paths(read_map((ROOT / "docs" / "architecture.md").read_text()))
    assert not missing, f"docs/architecture.md §2 names {missing}, which src/mmserve does not have"


PLANTED_MAP = """\
# a map

## 2. Layout

```
src/mmserve/
  config.py            frozen dataclasses         outputs.py  RequestOutput
  engine/              composition: see `core/step.py` and mmserve/faults.py
    llm_engine.py      Engine; the step loop, as
                       continued here: stats.py
  models/
    <family>/          one folder per family, each with config.py and model.py
      qwen2_vl/ mrope.py
tests/                 conftest.py
```
"""


def test_the_map_checks_catch_planted_mistakes(tmp_path):
    source_map = read_map(PLANTED_MAP)
    assert source_map.modules == {"": {"config.py", "outputs.py"}, "engine": {"llm_engine.py", "stats.py"},
                                  "models": set(), f"models/{FAMILY_TEMPLATE}": {"config.py", "model.py"},
                                  "models/qwen2_vl": {"mrope.py"}}
    assert source_map.families == {"models/qwen2_vl"}
    for module in ("config.py", "outputs.py", "engine/llm_engine.py", "engine/config.py",
                   "models/qwen2_vl/config.py", "models/qwen2_vl/model.py", "models/qwen2_vl/mrope.py",
                   "models/gemma3/mrope.py", "models/__init__.py"):
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).write_text("")
    # a basename named elsewhere in the map does not name a module of another folder
    assert unmapped_modules(source_map, tmp_path) == ["engine/config.py", "models/gemma3/mrope.py"]
    assert missing_paths(source_map, tmp_path) == ["engine/stats.py"]
    (tmp_path / "models" / "qwen2_vl" / "model.py").unlink()
    (tmp_path / "engine" / "stats.py").write_text("")
    assert missing_paths(source_map, tmp_path) == ["models/<family>/model.py"]


def test_the_readme_lists_every_served_architecture():
    readme = (ROOT / "README.md").read_text()
    missing = [arch for arch in supported_architectures() if f"| `{arch}` |" not in readme]
    assert not missing, f"README's architectures table lacks {missing}"
