"""Every code block of README.md and docs/*.md runs against the bundled demo model (tests/docs/snippets.py
says how each kind of block runs), one test per page; and the harness fails on planted bad blocks, so a
page whose snippet breaks cannot pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.snippets import ROOT, SnippetFailed, collect, commands, point_at, run_page

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_block_of_the_page_runs(page: Path, request, tmp_path):
    needs_server = any(block.directive == "server" for block in collect(page))
    port = request.getfixturevalue("docs_server").port if needs_server else None
    not_run = run_page(page, tmp_path, port)
    assert not not_run, "blocks not run: " + "; ".join(not_run)


def _page(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "page.md"
    path.write_text(text)
    return path


PLANTED = {
    "a Python block that raises": "```python\nx = 1\n```\n\ntext\n\n```python\nassert x == 2, 'planted'\n```\n",
    "a name another block never defined": "```python\nprint(picture_data_uri)\n```\n",
    "a shell block that fails": "```bash\ntrue\nfalse\necho after\n```\n",
    "a block that says nothing of what it is": "```\nls\n```\n",
    "a language the harness does not run": "```ruby\nputs 1\n```\n",
    "JSON that does not parse": "```json\n{\"a\": 1,}\n```\n",
    "a covered-by naming no test": "<!-- docs: covered-by tests/e2e/test_cli.py::test_absent -->\n```bash\nx\n```\n",
    "an unknown directive": "<!-- docs: sometimes -->\n```bash\ntrue\n```\n",
    "a server block without a server": "<!-- docs: server -->\n```bash\ncurl -s http://127.0.0.1:8000/health\n```\n",
}


@pytest.mark.parametrize("text", PLANTED.values(), ids=PLANTED.keys())
def test_a_page_with_a_bad_block_fails(text, tmp_path):
    page = _page(tmp_path, "# planted\n\n" + text)
    with pytest.raises(SnippetFailed) as failed:
        run_page(page, tmp_path / "run", server_port=None)
    assert "page.md:" in str(failed.value)


def test_blocks_share_a_page_namespace_and_text_is_not_run(tmp_path):
    page = _page(tmp_path, "```python\nfor answer in (41, 42):\n    pass\n```\n\n```text\nthis is output, never run\n```\n\n"
                           "- in a list:\n\n  ```python\n  assert answer == 42\n  open('made.txt', 'w').write('x')\n"
                           "  ```\n\n```bash\ntest -f made.txt && test -x .venv/bin/python\n```\n")
    assert [block.language for block in collect(page)] == ["python", "text", "python", "bash"]
    assert run_page(page, tmp_path / "run", server_port=None) == []
    assert (tmp_path / "run" / "made.txt").exists() and not (ROOT / "made.txt").exists()


def test_the_documented_port_is_pointed_at_the_test_server():
    assert point_at("curl http://127.0.0.1:8000/v1/models; mmserve serve --port 8000", 4321) == \
        "curl http://127.0.0.1:4321/v1/models; mmserve serve --port 4321"
    assert point_at("base_url='http://localhost:8000/v1' port 80001", 5) == "base_url='http://localhost:5/v1' port 80001"
    assert commands("# a comment\nmmserve serve \\\n  --port 8000\n\necho hi\n") == \
        ["mmserve serve    --port 8000", "echo hi"]
