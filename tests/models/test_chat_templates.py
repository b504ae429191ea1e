"""Chat templates are found and rendered as transformers finds and renders them, for every family: a
template written like the family's published one (`tests/fixtures/hub_templates.py`: generation blocks,
tools, tool calls, reasoning, namespaces, loop controls, `strftime_now`, special tokens) renders every
conversation of a set to the same text as transformers' `apply_chat_template`, or is refused by both; and a
checkpoint's template is taken from where transformers takes it (`chat_template.jinja` with
`additional_chat_templates/`, the legacy `chat_template.json`, `tokenizer_config.json`'s string or named list)."""

from __future__ import annotations

import json
import shutil

import jinja2
import numpy as np
import pytest
from transformers import AutoTokenizer

from mmserve import InvalidInputError, ModelLoadError
from mmserve.inputs.tokenizer import TextTokenizer
from testkit.conversations import random_image
from testkit.families import FAMILIES
from tests.fixtures.hub_templates import TEMPLATES
from tests.models.helpers import load_processor

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "description": "Ünïcode city"}},
                                               "required": ["city"]}}}]


def _conversations(takes_video: bool) -> list[tuple[list[dict], dict]]:
    """(OpenAI-style messages with PIL pictures, template variables)."""
    rng = np.random.default_rng(0)
    image = {"type": "image_pil", "image_pil": random_image(rng, 40, 30)}
    video = {"type": "video", "video": [random_image(rng, 32, 32)] * 2}
    text = lambda t: {"type": "text", "text": t}  # noqa: E731
    out = [
        ([{"role": "user", "content": "Hello there."}], {}),
        ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": [image, text("What is it?")]}], {}),
        ([{"role": "user", "content": [image, text("Describe.")]},
          {"role": "assistant", "content": [text("A blur of colours.")]},
          {"role": "user", "content": [text("And this one? "), image]}], {"add_vision_id": True}),
        ([{"role": "user", "content": [text("  padded text  ")]},
          {"role": "assistant", "content": "Sure.", "reasoning_content": "\nThe user wants it padded.\n"},
          {"role": "user", "content": "Again."}], {"enable_thinking": False}),
        ([{"role": "system", "content": [text("You call tools.")]}, {"role": "user", "content": "Weather in Oslo?"},
          {"role": "assistant", "content": None, "tool_calls": [
              {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
          {"role": "tool", "content": "-3 C"}, {"role": "user", "content": "Thanks."}], {"tools": TOOLS}),
    ]
    if takes_video:
        out.append(([{"role": "user", "content": [video, text("What happens?"), image]}], {"add_vision_id": True}))
    return out


def _for_transformers(messages: list[dict]) -> list[dict]:
    """The same conversation as transformers takes it: media parts as {"type": "image" | "video"}."""
    def part(p):
        return {"type": "image"} if p["type"] == "image_pil" else {"type": "video"} if p["type"] == "video" else p
    return [dict(m, content=[part(p) for p in m["content"]]) if isinstance(m.get("content"), list) else m
            for m in messages]


def _checkpoint_with(model_dir, tmp_path, layout: str, template: str):
    """A copy of the checkpoint whose chat template sits where `layout` says (and nowhere else)."""
    out = tmp_path / layout
    shutil.copytree(model_dir, out)
    for name in ("chat_template.jinja", "chat_template.json"):
        (out / name).unlink(missing_ok=True)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    if layout == "jinja":
        (out / "chat_template.jinja").write_text(template)
        (out / "additional_chat_templates").mkdir()
        (out / "additional_chat_templates" / "terse.jinja").write_text("{{ messages[0]['content'] }}")
    elif layout == "legacy_json":
        (out / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    elif layout == "tokenizer_config":
        config["chat_template"] = template
    elif layout == "named_list":
        config["chat_template"] = [{"name": "terse", "template": "{{ messages[0]['content'] }}"},
                                   {"name": "default", "template": template}]
    config_path.write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("layout", ["jinja", "legacy_json", "tokenizer_config", "named_list"])
def test_the_template_is_taken_from_where_transformers_takes_it(served_family, served_model_dir, tmp_path, layout):
    template = TEMPLATES[served_family]
    ckpt = _checkpoint_with(served_model_dir, tmp_path, layout, template)
    assert TextTokenizer(ckpt).chat_template == template
    if layout != "legacy_json":  # (transformers' tokenizer does not read the processor's legacy file)
        hf = AutoTokenizer.from_pretrained(ckpt)
        assert hf.get_chat_template() == template


def test_several_templates_and_none_named_default_is_refused(served_model_dir, tmp_path):
    ckpt = _checkpoint_with(served_model_dir, tmp_path, "none", "")
    config_path = ckpt / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = [{"name": "a", "template": "x"}, {"name": "b", "template": "y"}]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="none named 'default': a, b"):
        TextTokenizer(ckpt)


def test_hub_style_templates_render_as_transformers_renders_them(served_family, served_model_dir, tmp_path):
    template = TEMPLATES[served_family]
    ckpt = _checkpoint_with(served_model_dir, tmp_path, "jinja", template)
    processor = load_processor(ckpt)
    hf = AutoTokenizer.from_pretrained(ckpt)
    rendered = 0
    for messages, variables in _conversations(FAMILIES[served_family].takes_video):
        try:
            want = hf.apply_chat_template(_for_transformers(messages), tokenize=False, add_generation_prompt=True,
                                          **variables)
        except jinja2.exceptions.TemplateError as exc:  # the template refuses this conversation: so must we
            with pytest.raises(InvalidInputError, match="chat template rejected the messages"):
                processor.render_chat(messages, **variables)
            assert str(exc)
            continue
        chat = processor.render_chat(messages, **variables)
        assert chat.prompt == want, f"{served_family}: {messages}"
        rendered += 1
    assert rendered >= 3


def test_a_gemma_conversation_that_does_not_alternate_is_refused_by_its_template(all_checkpoints, tmp_path):
    ckpt = _checkpoint_with(all_checkpoints["gemma3"], tmp_path, "jinja", TEMPLATES["gemma3"])
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(InvalidInputError, match="Conversation roles must alternate"):
        load_processor(ckpt).render_chat(messages)


def test_the_demo_models_template_renders_tools_as_transformers(tmp_path):
    """The bundled demo model's template renders tools, assistant tool calls and tool results (and every
    other conversation of the set) to transformers' text; without tools, as the plain Qwen2-VL one does."""
    from mmserve.demo.eval import default_model_dir
    from mmserve.models.qwen2_vl.chat_template import QWEN2_VL_CHAT_TEMPLATE

    processor = load_processor(default_model_dir())
    hf = AutoTokenizer.from_pretrained(default_model_dir())
    plain = _checkpoint_with(default_model_dir(), tmp_path, "jinja", QWEN2_VL_CHAT_TEMPLATE)
    plain_processor = load_processor(plain)
    for messages, variables in _conversations(True):
        want = hf.apply_chat_template(_for_transformers(messages), tokenize=False, add_generation_prompt=True,
                                      **variables)
        assert processor.render_chat(messages, **variables).prompt == want
        if "tools" in variables:
            assert "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>" in want
            assert "<tool_response>\n-3 C\n</tool_response>" in want
        else:
            assert plain_processor.render_chat(messages, **variables).prompt == want
