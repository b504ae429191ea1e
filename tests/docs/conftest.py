"""The docs tier's fixtures: one demo-model server for every snippet that talks to a server (started on
first use, stopped at the end of the session)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import running_server


@pytest.fixture(scope="session")
def docs_server(tmp_path_factory):
    """`mmserve serve` on the bundled demo model, as the docs' `mmserve serve` starts it, on a free port."""
    with running_server(None, tmp_path_factory.mktemp("docs-server") / "serve.log") as server:
        yield server
