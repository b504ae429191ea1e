"""Where pip finds packages on this machine, as uv flags (for scripts/setup.sh).

uv reads neither pip.conf nor PIP_* variables, so a machine whose packages come from pip's
configuration (find-links with a local CPU torch, extra indexes, a constraints file) would send uv to
PyPI alone. This reads pip's merged configuration (`pip config list`: the files, then PIP_* over them,
as pip itself ranks them) and prints, one per line, the uv flags naming the same sources; with
`--has-wheel GLOB` a last line says whether a local find-links folder holds such a wheel
(`has-wheel: yes` or `has-wheel: no`). One call, since asking pip is most of its time.

What it does not know: which packages are installed, or whether a named index answers.
"""

from __future__ import annotations

import argparse
import glob
import os
import shlex
import subprocess
import sys
from pathlib import Path

# pip option -> uv flag; each value may list several entries, separated by white space
FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}


def pip_config(python: str) -> dict[str, str]:
    """pip's settings by option name; an environment variable's value wins over the files' (pip's order)."""
    listed = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    from_files: dict[str, str] = {}
    from_env: dict[str, str] = {}
    for line in listed.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        scope, _, name = key.rpartition(".")
        value = shlex.split(value)[0] if value.strip() else ""
        if scope == ":env:":
            from_env[name] = value
        elif scope in ("global", "install"):  # `install.` is more specific than `global.`: read last
            if scope == "install" or name not in from_files:
                from_files[name] = value
    return {**from_files, **from_env}


def uv_flags(config: dict[str, str]) -> list[str]:
    flags = ["--index-strategy", "unsafe-best-match"]  # pip weighs every index; uv's default stops at the first
    for name, flag in FLAGS.items():
        for entry in config.get(name, "").split():
            flags += [flag, entry]
    if config.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        flags.append("--no-index")
    return flags


def local_wheel(config: dict[str, str], pattern: str) -> str | None:
    for entry in config.get("find-links", "").split():
        folder = entry.removeprefix("file://")
        if os.path.isdir(folder):
            found = sorted(glob.glob(str(Path(folder) / pattern)))
            if found:
                return found[-1]
    return None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="the Python whose pip is asked")
    parser.add_argument("--has-wheel", metavar="GLOB", help="also say whether a local find-links folder holds GLOB")
    args = parser.parse_args(argv)
    config = pip_config(args.python)
    lines = uv_flags(config)
    if args.has_wheel:
        lines.append(f"has-wheel: {'yes' if local_wheel(config, args.has_wheel) else 'no'}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
