"""Tokenizer and chat template read from a checkpoint directory, without transformers.

Role: `tokenizer.json` through the `tokenizers` library; the chat template from
`chat_template.jinja`, `chat_template.json` or `tokenizer_config.json`, rendered with jinja2 in a
sandbox the way Hugging Face renders it (trim_blocks, lstrip_blocks, `tojson`,
`raise_exception`). What it does not know: images, placeholders' meaning, models.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from mmserve.errors import InvalidInputError, ModelLoadError


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file's object, or {} when the file is absent."""
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def load_chat_template(model_dir: Path) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    for source in (read_json(model_dir / "chat_template.json"), read_json(model_dir / "tokenizer_config.json")):
        template = source.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template:
            return template
    return None


class TextTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"no tokenizer.json in {model_dir}")
        self._tok = Tokenizer.from_file(str(path))
        config = read_json(root / "tokenizer_config.json")
        self.eos_token: str | None = _token_content(config.get("eos_token"))
        self.bos_token: str | None = _token_content(config.get("bos_token"))
        self.eos_token_id: int | None = self.token_to_id(self.eos_token) if self.eos_token else None
        self.special_token_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        self.chat_template = load_chat_template(root)
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                  extensions=["jinja2.ext.loopcontrols"])
        self._env.filters["tojson"] = _tojson
        self._env.globals["raise_exception"] = _raise_exception
        self._env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._compiled = self._env.from_string(self.chat_template) if self.chat_template else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        if self._compiled is None:
            raise InvalidInputError("this model has no chat template; pass a plain prompt instead")
        try:
            # the special tokens transformers hands every template (Mistral's and Gemma's open with bos_token)
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **{"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs})
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidInputError(f"chat template rejected the messages: {exc}") from exc
