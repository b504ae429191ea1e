"""The documentation site builds with `mkdocs build --strict` (a broken link or anchor, or a page left out
of the navigation, fails it; a planted broken link proves the check can fail), and the README stays a
short entry point whose links lead to pages that exist."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.docs.snippets import ROOT

README_MAX_LINES = 300


def _mkdocs_build(root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=root,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))


def test_the_site_builds_strictly(tmp_path):
    built = _mkdocs_build(ROOT, tmp_path / "site")
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "server" / "index.html").is_file()


def test_a_broken_link_fails_the_strict_build(tmp_path):
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    index = tmp_path / "docs" / "index.md"
    index.write_text(index.read_text() + "\nSee [the missing page](missing.md).\n")
    built = _mkdocs_build(tmp_path, tmp_path / "site")
    assert built.returncode != 0 and "missing.md" in built.stdout + built.stderr


def test_the_readme_is_short_and_its_links_lead_somewhere():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, f"README.md has {len(readme.splitlines())} lines"
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [target for target in targets if "://" not in target]
    assert "docs/install.md" in local and "docs/server.md" in local
    missing = [target for target in local if not (ROOT / target).exists()]
    assert not missing, f"README.md links to {missing}, which do not exist"
