"""`option()`: an engine argument's dataclass field, with the one line of help the command line prints.

Role: the config dataclasses (`config.py`, `inputs/media.py`) declare each engine argument with its default,
a help line, the default as a user reads it where the value is derived (`shown`: "256MiB", "the model's"),
and its choices; the CLI builds one flag per field from these, so a flag's help is written once, beside
the field it sets.

What it does not know: argparse, what any argument means.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


def option(default: Any, help: str, shown: str | None = None, choices: Sequence[str] | None = None) -> Any:
    """A field with `default`; `help`, `shown` (the default as a user reads it) and `choices` for the CLI."""
    return dataclasses.field(default=default, metadata={"help": help, "shown": shown,
                                                        "choices": tuple(choices) if choices else None})
