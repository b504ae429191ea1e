"""A checkpoint's chat template, found and rendered as transformers finds and renders it.

Role: `load_chat_template` looks where transformers looks: `chat_template.jinja` (with any named
templates in `additional_chat_templates/`), else the legacy `chat_template.json`, else the
`chat_template` of `tokenizer_config.json` (a string, or a list of named templates); of several, the
one named "default" is used. `ChatTemplate` renders it in the environment transformers builds: a
sandbox with trim_blocks and lstrip_blocks, loop controls, the `{% generation %}` block (assistant
masks: rendered as its body), `raise_exception`, `strftime_now`, a `tojson` with indent, separators
and ensure_ascii, a `dict` and a `namespace` that refuse underscore names. The template sees what
transformers passes: `messages` (keys whose value is None dropped, reasoning under
`reasoning_content` and `thinking` whatever name it came under), `tools` and `documents` (None when
not given), `add_generation_prompt`, every named special token of the tokenizer (`bos_token`,
`eos_token`, `pad_token`, a model's `image_token`, ...), and the caller's template variables.

What it does not know: media (a part is `{"type": "image"}` by the time it gets here), tokenizers.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mmserve.errors import InvalidInputError, ModelLoadError

DEFAULT = "default"
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is what templates read


# the tags a thinking template opens and closes its thought with (Qwen3-VL Thinking, DeepSeek-R1 style)
THOUGHT_OPEN, THOUGHT_CLOSE = "<think>", "</think>"
CHANNEL_OPEN, CHANNEL_CLOSE = "<|channel>", "<channel|>"  # Gemma 4's thought: a channel the template opens


def thinks(chat_template: str | None) -> bool:
    """Does the template think (render a thought between `THOUGHT_OPEN` and `THOUGHT_CLOSE`)?"""
    return bool(chat_template) and THOUGHT_OPEN in chat_template


def thought_tag_pair(chat_template: str | None) -> tuple[str, str] | None:
    """The (open, close) tags a template's thoughts are written between: Gemma 4's channel, or `<think>`'s;
    None: the template does not think."""
    if chat_template and CHANNEL_OPEN in chat_template:
        return CHANNEL_OPEN, CHANNEL_CLOSE
    return (THOUGHT_OPEN, THOUGHT_CLOSE) if thinks(chat_template) else None

def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def load_chat_templates(model_dir: Path) -> dict[str, str]:
    """Name -> template, from the first place transformers finds any (empty: the model has none)."""
    named = {p.stem: p.read_text() for p in sorted((model_dir / "additional_chat_templates").glob("*.jinja"))}
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return {DEFAULT: jinja_file.read_text(), **named}
    if named:
        return named
    legacy = _read_json(model_dir / "chat_template.json").get("chat_template")
    if legacy:
        return {DEFAULT: legacy}
    config = _read_json(model_dir / "tokenizer_config.json").get("chat_template")
    if isinstance(config, list):
        return {t["name"]: t["template"] for t in config}
    return {DEFAULT: config} if config else {}


def read_chat_template_arg(value: str) -> str:
    """vLLM's --chat-template: a file's path (its text), else the template itself inline (its backslash
    escapes decoded, as vLLM decodes them)."""
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # no path can be this (a name too long): the template itself
        pass
    if any(marker in value for marker in ("{{", "{%")):
        return codecs.decode(value, "unicode_escape")
    raise InvalidInputError(f"chat_template {value!r}: no such file, and not a template inline (no {{{{ or {{%)",
                            param="chat_template", setting="chat_template")


def load_chat_template(model_dir: Path) -> str | None:
    """The template transformers renders when none is named: "default" (None: the model has no template)."""
    templates = load_chat_templates(model_dir)
    if templates and DEFAULT not in templates:
        raise ModelLoadError(f"{model_dir} has several chat templates and none named {DEFAULT!r}: "
                             f"{', '.join(sorted(templates))}")
    return templates.get(DEFAULT)


class GenerationBlock(jinja2.ext.Extension):
    """`{% generation %} ... {% endgeneration %}`: marks assistant text for training masks; renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` without the type itself in the sandbox."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore names (no way into the interpreter's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja2's signature trick, as Namespace's own
        self, args = args[0], args[1:]
        for name in dict(*args, **kwargs):
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, *args, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # not jinja2's own tojson, which escapes HTML characters
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_TemplateNamespace)
    return env


def _plain(value: Any) -> Any:
    """Only plain JSON values reach a template (anything else becomes a placeholder naming its type)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, np.generic):  # np.bool_(False) must not become a truthy placeholder
        return _plain(value.item())
    for kind in (str, int, float):  # subclasses (enums, ...) carry methods: back to the base type
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as transformers hands them to a template: no None-valued keys, reasoning aliased."""
    out = []
    for message in messages:
        message = {k: _plain(v) for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class ChatTemplate:
    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens)
        try:
            self._compiled = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ModelLoadError(f"the chat template does not parse: {exc}") from exc

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               **variables: Any) -> str:
        for name in ("messages", "add_generation_prompt"):
            if name in variables:
                raise InvalidInputError(f"{name!r} is not a template variable a request may set", param=name)
        context = {"tools": None, "documents": None, **self.special_tokens, **_plain(variables)}
        try:
            return self._compiled.render(messages=template_messages(messages),
                                         add_generation_prompt=add_generation_prompt, **context)
        except (jinja2.exceptions.TemplateError, TypeError, ValueError) as exc:
            # a TypeError or ValueError is the messages' shape meeting a filter (`|items` on a call's arguments
            # that are text, not an object): the request's fault, as a raise_exception is
            raise InvalidInputError(f"chat template rejected the messages: {exc}", param="messages") from exc
