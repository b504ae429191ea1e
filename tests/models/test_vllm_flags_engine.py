"""vLLM's flags that reach the engine or the server, on a tiny checkpoint: --chat-template (a file or the
template inline), --tokenizer (another directory's tokenizer and template), --max-model-len past the
model's positions (refused unless the environment allows it), --trust-remote-code (answered once),
--enable-server-load-tracking (GET /load) and --enable-force-include-usage."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from mmserve import LLM, InvalidInputError
from mmserve.config import EngineConfig
from mmserve.engine import frontend as frontend_module
from mmserve.engine.frontend import Frontend
from mmserve.envs import ALLOW_LONG_MAX_MODEL_LEN, VLLM_ALLOW_LONG_MAX_MODEL_LEN

HELLO = [{"role": "user", "content": "hello"}]


def _prompt(model_dir, **kwargs):
    frontend = Frontend(EngineConfig.from_kwargs(str(model_dir), **kwargs))
    return frontend.processor.render_chat(HELLO).prompt


def test_chat_template_from_a_file_or_inline(checkpoint_dirs, tmp_path):
    model_dir = checkpoint_dirs["qwen2_vl"]
    inline = "[{{ messages[0]['role'] }}]\\nend"
    assert _prompt(model_dir, chat_template=inline) == "[user]\nend"  # backslash escapes decoded, as vLLM
    path = tmp_path / "template.jinja"
    path.write_text("FILE {{ messages | length }}")
    assert _prompt(model_dir, chat_template=str(path)) == "FILE 1"
    assert _prompt(model_dir) != "FILE 1"
    with pytest.raises(InvalidInputError, match="no such file") as refused:
        _prompt(model_dir, chat_template=str(tmp_path / "missing.jinja"))
    assert refused.value.param == "chat_template"


def test_tokenizer_from_another_directory(checkpoint_dirs, tmp_path):
    model_dir = checkpoint_dirs["qwen2_vl"]
    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tokenizer_dir / name)
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "TOK {{ messages[0]['role'] }}"
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    assert not (tokenizer_dir / "chat_template.jinja").exists()
    assert _prompt(model_dir, tokenizer=str(tokenizer_dir)) == "TOK user"
    # --chat-template wins over the tokenizer's
    assert _prompt(model_dir, tokenizer=str(tokenizer_dir), chat_template="T{{ 1 + 1 }}") == "T2"


def test_max_model_len_past_the_positions_is_refused_unless_meant(checkpoint_dirs, monkeypatch):
    monkeypatch.delenv(ALLOW_LONG_MAX_MODEL_LEN, raising=False)
    monkeypatch.delenv(VLLM_ALLOW_LONG_MAX_MODEL_LEN, raising=False)
    with pytest.raises(InvalidInputError, match="max_model_len=4096 is longer than the model's 2048") as refused:
        LLM(str(checkpoint_dirs["qwen2_vl"]), max_model_len=4096)
    assert refused.value.param == "max_model_len"
    monkeypatch.setenv(VLLM_ALLOW_LONG_MAX_MODEL_LEN, "1")
    assert LLM(str(checkpoint_dirs["qwen2_vl"]), max_model_len=4096).engine.frontend.max_model_len == 4096


def test_trust_remote_code_is_answered_once(checkpoint_dirs, caplog, monkeypatch):
    monkeypatch.setattr(frontend_module, "_said_no_remote_code", False)
    with caplog.at_level(logging.INFO, logger="mmserve.engine"):
        for _ in range(2):
            Frontend(EngineConfig.from_kwargs(str(checkpoint_dirs["qwen2_vl"]), trust_remote_code=True))
    assert sum("runs no code from a checkpoint" in r.message for r in caplog.records) == 1


def _server(llm, **server_config):
    from fastapi.testclient import TestClient

    from mmserve.engine.async_engine import AsyncEngine
    from mmserve.entrypoints.openai.media import MediaRules
    from mmserve.entrypoints.openai.server import build_app
    from mmserve.entrypoints.openai.serving import ServerConfig

    config = ServerConfig("m", MediaRules(llm.engine.config.media), **server_config)
    return TestClient(build_app(AsyncEngine(llm.engine), config))


def _events(reply):
    return [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]


def test_server_load_tracking_and_forced_usage(checkpoint_dirs):
    llm = LLM(str(checkpoint_dirs["qwen2_vl"]))
    body = {"model": "m", "messages": HELLO, "max_tokens": 3, "stream": True}
    with _server(llm, server_load_tracking=True, force_include_usage=True) as client:
        assert client.get("/load").json() == {"server_load": 0}
        with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            assert client.get("/load").json() == {"server_load": 1}  # the stream is still open
            events = _events(reply)
        assert client.get("/load").json() == {"server_load": 0}
        assert events[-1]["usage"]["completion_tokens"] == 3  # no stream_options asked for it
    with _server(llm) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            assert client.get("/load").json() == {"server_load": 0}  # not tracked unless asked
            events = _events(reply)
        assert all(e.get("usage") is None for e in events)
    llm.check_integrity()


def test_mm_processor_kwargs_are_every_requests_defaults(checkpoint_dirs):
    from PIL import Image

    model_dir = str(checkpoint_dirs["qwen2_vl"])
    image = Image.new("RGB", (224, 224), "red")
    chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": "hi"}]}]
    plain = Frontend(EngineConfig.from_kwargs(model_dir)).process_chat(chat)
    small = Frontend(EngineConfig.from_kwargs(model_dir, mm_processor_kwargs={"max_pixels": 56 * 56}))
    assert small.process_chat(chat).num_tokens < plain.num_tokens
    # a request's own kwargs win over the defaults
    assert small.process_chat(chat, {"max_pixels": 224 * 224}).num_tokens == plain.num_tokens
    with pytest.raises(InvalidInputError, match="mm_processor_kwargs: unsupported") as refused:
        Frontend(EngineConfig.from_kwargs(model_dir, mm_processor_kwargs={"no_such_kwarg": 1}))
    assert refused.value.param == "mm_processor_kwargs"


def test_default_chat_template_kwargs_are_every_chats_defaults(checkpoint_dirs):
    config = EngineConfig.from_kwargs(str(checkpoint_dirs["qwen2_vl"]), chat_template="{{ greeting }}!",
                                      default_chat_template_kwargs={"greeting": "hi"})
    frontend = Frontend(config)
    assert frontend.processor.tokenizer.decode(frontend.process_chat(HELLO).prompt_token_ids) == "hi!"
    assert frontend.processor.tokenizer.decode(frontend.process_chat(HELLO, greeting="yo").prompt_token_ids) == "yo!"
