"""Small readers of config.json fields that every family's config parser shares.

What it does not know: any family's layout; it reads single values.
"""

from __future__ import annotations

from typing import Any


def token_ids(value: Any) -> tuple[int, ...]:
    """A token id field given as an int, a list of ints, or absent (None) -> a tuple of ints."""
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)
