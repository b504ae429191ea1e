"""The benchmarks' PNG plumbing: matplotlib when installed (the optional `bench` extra), and saving.

Role: `pyplot()` returns matplotlib's pyplot on the headless Agg backend, or None when matplotlib is
not installed; `save(fig, path)` writes a figure and closes it. Each returns or takes the one line a
benchmark prints about its plot. What it does not know: what is plotted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

NOT_INSTALLED = "not written: matplotlib is not installed (pip install -e '.[bench]')"


def pyplot() -> Any | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save(fig: Any, path: Path) -> str:
    """Write `fig` to `path` (its folder made if missing), close it; the line to print."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt  # a figure exists: so does matplotlib

    plt.close(fig)
    return f"written to {path}"
