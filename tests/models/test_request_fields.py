"""Request fields of the OpenAI routes that change what happens, over the app in process (one tiny Qwen2-VL
engine): beam search (`use_beam_search`, `n`, `length_penalty`, `early_stopping`) answers what the offline
`LLM.beam_search` finds (tests/models/test_beam_search.py holds that against transformers), streamed at its
end; `return_tokens_as_token_ids` per request; chat `echo`; `truncation_side`; `chat_template_kwargs`; and
the refusals: a field beam search cannot honour, a modifier without what it modifies, a field no one
defines — each a 400 naming the field."""

from __future__ import annotations

import base64
import io
import json
import re

import numpy as np
import pytest
from fastapi.testclient import TestClient

from mmserve import LLM, BeamSearchParams, InvalidInputError, SamplingParams
from mmserve.engine.async_engine import AsyncEngine
from mmserve.entrypoints.openai.chat import ChatCompletionRequest
from mmserve.entrypoints.openai.completions import CompletionRequest
from mmserve.entrypoints.openai.media import MediaRules
from mmserve.entrypoints.openai.protocol import GUIDED_FIELDS, IDENTITY_FIELDS, UNSUPPORTED_FIELDS
from mmserve.entrypoints.openai.server import build_app
from mmserve.entrypoints.openai.serving import ServerConfig
from testkit.conversations import random_image

QUESTION = [{"role": "user", "content": "Tell me a story about a fox."}]


@pytest.fixture(scope="module")
def offline(checkpoint_dirs):
    """What the offline API answers, computed before the engine is handed to the server."""
    llm = LLM(str(checkpoint_dirs["qwen2_vl"]))
    chat = llm.engine.processor.render_chat(QUESTION)
    found = {}
    for width, lp, es in ((2, 1.0, False), (3, 0.5, True)):
        (out,) = llm.beam_search([chat.prompt], BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=lp,
                                                                 early_stopping=es))
        found[width] = out
    (text_out,) = llm.beam_search(["The fox"], BeamSearchParams(beam_width=2, max_tokens=5, early_stopping="never"))
    found["completion"] = text_out
    return llm, found


@pytest.fixture(scope="module")
def client(offline):
    llm, _ = offline
    app = build_app(AsyncEngine(llm.engine), ServerConfig("m", MediaRules(llm.engine.config.media)))
    with TestClient(app) as test_client:
        yield test_client
    llm.check_integrity()  # every beam's step request, every refusal: nothing leaked


def _chat(client, **body):
    return client.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 6, **body})


def _refused(response, param):
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def _stream(client, route, body):
    with client.stream("POST", route, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_use_beam_search_chat_answers_the_offline_beams(client, offline):
    """n beams, length_penalty and early_stopping: the choices are LLM.beam_search's hypotheses, best first."""
    _, found = offline
    for width, lp, es in ((2, 1.0, False), (3, 0.5, True)):
        reply = _chat(client, use_beam_search=True, n=width, length_penalty=lp, early_stopping=es,
                      return_token_ids=True, logprobs=True, top_logprobs=2)
        assert reply.status_code == 200, reply.text
        choices = reply.json()["choices"]
        expected = [s.tokens[-len(c["token_ids"]):] for s, c in zip(found[width].sequences, choices)]
        assert [c["token_ids"] for c in choices] == expected and len(choices) == width
        assert [c["message"]["content"] for c in choices] == [s.text for s in found[width].sequences]
        first = choices[0]["logprobs"]["content"]
        assert len(first) == len(choices[0]["token_ids"]) and len(first[0]["top_logprobs"]) == 2
    chunks = _stream(client, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 6, "use_beam_search": True,
                                                      "n": 2})
    texts = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
    assert [texts[0], texts[1]] == [s.text for s in found[2].sequences]


def test_use_beam_search_completions(client, offline):
    _, found = offline
    body = {"prompt": "The fox", "max_tokens": 5, "use_beam_search": True, "n": 2, "early_stopping": "never"}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert [c["text"] for c in reply.json()["choices"]] == [s.text for s in found["completion"].sequences]
    assert reply.json()["usage"]["completion_tokens"] == sum(len(s.logprobs) for s in found["completion"].sequences)
    streamed = {}
    for chunk in _stream(client, "/v1/completions", body):
        for c in chunk["choices"]:
            streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
    assert [streamed[0], streamed[1]] == [c["text"] for c in reply.json()["choices"]]


@pytest.mark.parametrize("field,value", [("top_p", 0.5), ("top_k", 3), ("min_p", 0.1), ("seed", 1), ("stop", ["x"]),
                                         ("stop_token_ids", [3]), ("min_tokens", 2), ("presence_penalty", 0.5),
                                         ("frequency_penalty", 0.5), ("repetition_penalty", 1.2),
                                         ("logit_bias", {"3": 1}), ("allowed_token_ids", [3, 4]),
                                         ("bad_words", ["fox"]), ("prompt_logprobs", 1),
                                         ("response_format", {"type": "json_object"}), ("temperature", 0.7),
                                         ("n", 11)])
def test_use_beam_search_refuses_what_it_cannot_honour(client, field, value):
    _refused(_chat(client, **{"use_beam_search": True, "n": 2, field: value}), field)


def test_length_penalty_and_early_stopping_need_use_beam_search(client):
    _refused(_chat(client, length_penalty=2.0), "length_penalty")
    _refused(_chat(client, early_stopping=True), "early_stopping")
    _refused(client.post("/v1/completions", json={"prompt": "a", "echo": True, "logprobs": 1, "use_beam_search": True,
                                                  "max_tokens": 2}), "echo")


def test_return_tokens_as_token_ids_per_request(client):
    named = _chat(client, max_tokens=3, temperature=0, logprobs=True, top_logprobs=1, return_token_ids=True,
                  return_tokens_as_token_ids=True).json()["choices"][0]
    assert [e["token"] for e in named["logprobs"]["content"]] == [f"token_id:{t}" for t in named["token_ids"]]
    plain = _chat(client, max_tokens=3, temperature=0, logprobs=True, return_tokens_as_token_ids=False).json()
    assert not any(e["token"].startswith("token_id:") for e in plain["choices"][0]["logprobs"]["content"])
    completion = client.post("/v1/completions", json={"prompt": "The fox", "max_tokens": 2, "logprobs": 1,
                                                      "echo": True, "return_tokens_as_token_ids": True}).json()
    assert all(t.startswith("token_id:") for t in completion["choices"][0]["logprobs"]["tokens"])
    _refused(_chat(client, return_tokens_as_token_ids=True), "return_tokens_as_token_ids")


def test_chat_echo_prepends_the_last_message_of_the_answers_role(client):
    prefill = [*QUESTION, {"role": "assistant", "content": "Once upon"}]
    body = {"messages": prefill, "max_tokens": 3, "temperature": 0, "continue_final_message": True,
            "add_generation_prompt": False}
    plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    echoed = client.post("/v1/chat/completions", json={**body, "echo": True}).json()["choices"][0]["message"]
    assert echoed["content"] == "Once upon" + plain["content"] and echoed["role"] == "assistant"
    chunks = _stream(client, "/v1/chat/completions", {**body, "echo": True})
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == echoed["content"]
    # the last message is the user's, the answer the assistant's: nothing to echo
    reply = _chat(client, max_tokens=3, temperature=0, echo=True).json()["choices"][0]["message"]
    assert reply["content"] == _chat(client, max_tokens=3, temperature=0).json()["choices"][0]["message"]["content"]
    # with add_generation_prompt false the answer takes the last message's role, so it is echoed
    user_turn = _chat(client, max_tokens=2, temperature=0, echo=True, add_generation_prompt=False).json()
    message = user_turn["choices"][0]["message"]
    assert message["role"] == "user" and message["content"].startswith(QUESTION[0]["content"])


def test_truncation_side_keeps_the_first_or_the_last_tokens(client, offline):
    ids = list(range(20, 40))
    for side, kept in (("left", ids[-5:]), ("right", ids[:5]), (None, ids[-5:])):
        body = {"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 5, "return_token_ids": True,
                **({} if side is None else {"truncation_side": side})}
        reply = client.post("/v1/completions", json=body)
        assert reply.json()["choices"][0]["prompt_token_ids"] == kept, reply.text
    _refused(client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "truncation_side": "right"}),
             "truncation_side")
    _refused(client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 5,
                                                  "truncation_side": "middle"}), "truncation_side")


def test_offline_truncation_side(checkpoint_dirs):
    llm = LLM(str(checkpoint_dirs["qwen2_vl"]))
    ids = list(range(20, 40))
    for side, kept in (("left", ids[-4:]), ("right", ids[:4])):
        params = SamplingParams(max_tokens=1, truncate_prompt_tokens=4, truncation_side=side)
        (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        assert out.prompt_token_ids == kept
    for bad in ({"truncation_side": "right"}, {"truncate_prompt_tokens": 4, "truncation_side": "up"}):
        with pytest.raises(InvalidInputError) as exc:
            SamplingParams(**bad)
        assert exc.value.param == "truncation_side"
    llm.check_integrity()


def _png_uri(width: int, height: int) -> str:
    buffer = io.BytesIO()
    random_image(np.random.default_rng(0), width, height).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_chat_template_kwargs_reach_the_template(client):
    uri = _png_uri(32, 32)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                             {"type": "text", "text": "What is it?"}]}]
    plain = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    numbered = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1,
                                                         "chat_template_kwargs": {"add_vision_id": True}}).json()
    # "Picture 1: " before the image
    assert numbered["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]


def test_unknown_fields_are_refused_and_identity_fields_taken(client):
    _refused(_chat(client, max_tokens=1, colour="red"), "colour")
    _refused(_chat(client, max_tokens=1, priority=3), "priority")
    _refused(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "add_special_tokens": False}),
             "add_special_tokens")
    _refused(_chat(client, max_tokens=1, stream=True, stream_options={"include_usage": True, "colour": 1}),
             "stream_options.colour")
    for neutral in ({"user": "u-7"}, {"priority": 0}, {"store": False}, {"spaces_between_special_tokens": True}):
        assert _chat(client, max_tokens=1, **neutral).status_code == 200


def _greedy(client, **body):
    reply = _chat(client, **{"temperature": 0, "ignore_eos": True, "return_token_ids": True, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def test_sampling_fields_change_the_answer(client):
    """top_k, top_p and min_p at their tightest leave only the most likely token: a sampled answer is then the
    greedy one; a seed repeats an answer; max_completion_tokens bounds it; stop_token_ids end it."""
    greedy = _greedy(client, max_tokens=5)
    for tight in ({"top_k": 1}, {"top_p": 1e-9}, {"min_p": 1.0}):
        assert _greedy(client, max_tokens=5, **tight, temperature=1.5)["token_ids"] == greedy["token_ids"], tight
    seeded = [_greedy(client, max_tokens=5, temperature=1.5, seed=s)["token_ids"] for s in (11, 11, 12, 13)]
    assert seeded[0] == seeded[1] and len({tuple(t) for t in seeded}) > 1
    assert len(_greedy(client, max_tokens=5, max_completion_tokens=2)["token_ids"]) == 2
    stopped = _chat(client, max_tokens=5, temperature=0, return_token_ids=True,
                    stop_token_ids=[greedy["token_ids"][2]]).json()["choices"][0]
    assert stopped["token_ids"] == greedy["token_ids"][:3] and stopped["finish_reason"] == "stop"


def test_stop_strings_and_special_tokens_in_the_text(client, offline):
    llm, _ = offline
    greedy = _greedy(client, max_tokens=6)
    text = greedy["message"]["content"]
    stop = next(text[i:i + 2] for i in range(1, len(text) - 1) if not any(c.isspace() for c in text[i:i + 2]))
    cut = _chat(client, max_tokens=6, temperature=0, ignore_eos=True,
                stop=[stop]).json()["choices"][0]["message"]["content"]
    kept = _chat(client, max_tokens=6, temperature=0, ignore_eos=True, stop=[stop],
                 include_stop_str_in_output=True).json()["choices"][0]["message"]["content"]
    assert kept == cut + stop and cut == text[:text.index(stop)]
    special = llm.engine.eos_token_ids[0]  # a special token, forced: its text shows only unskipped
    shown = _greedy(client, max_tokens=2, allowed_token_ids=[special], skip_special_tokens=False)
    hidden = _greedy(client, max_tokens=2, allowed_token_ids=[special], skip_special_tokens=True)
    assert shown["token_ids"] == hidden["token_ids"] == [special, special]
    assert shown["message"]["content"] and not hidden["message"]["content"]


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_FIELDS))
def test_unsupported_fields_are_refused_unless_neutral(client, name):
    """OpenAI's and vLLM's fields mmserve does not implement: what asks for nothing passes, the rest is a 400."""
    for neutral in UNSUPPORTED_FIELDS[name]:
        assert _chat(client, max_tokens=1, **{name: neutral}).status_code == 200, (name, neutral)
    _refused(_chat(client, max_tokens=1, **{name: "not-neutral"}), name)


@pytest.mark.parametrize("route,request_class", [("/v1/chat/completions", ChatCompletionRequest),
                                                 ("/v1/completions", CompletionRequest)])
def test_route_unsupported_fields(client, route, request_class):
    base = {"messages": QUESTION} if route.endswith("chat/completions") else {"prompt": "The fox"}
    for name, neutrals in request_class.route_unsupported_fields.items():
        for neutral in neutrals:
            assert client.post(route, json={**base, "max_tokens": 1, name: neutral}).status_code == 200, name
        _refused(client.post(route, json={**base, "max_tokens": 1, name: "not-neutral"}), name)


@pytest.mark.parametrize("name", IDENTITY_FIELDS)
def test_identity_fields_change_no_answer(client, name):
    plain = _greedy(client, max_tokens=3)
    assert _greedy(client, max_tokens=3, **{name: "caller-7"})["token_ids"] == plain["token_ids"]


@pytest.mark.parametrize("name,value,pattern", [("guided_regex", "[0-9]{3}", r"[0-9]{3}"),
                                                ("guided_choice", ["yes", "no"], r"yes|no"),
                                                ("guided_json", {"type": "integer"}, r"-?[0-9]+"),
                                                ("guided_grammar", 'root ::= "up" | "down"', r"up|down")])
def test_guided_fields_constrain_the_output(client, name, value, pattern):
    """vLLM's older names of structured_outputs (GUIDED_FIELDS) constrain the answer as their new names do."""
    assert GUIDED_FIELDS[name] in ("json", "regex", "choice", "grammar")
    content = _chat(client, max_tokens=8, temperature=0, **{name: value}).json()["choices"][0]["message"]["content"]
    assert re.fullmatch(pattern, content), content


def test_model_names_the_served_model(client):
    """`model`: the served name (or none) answers; another is a 404 naming the field, on every route."""
    for route, body in (("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 1}),
                        ("/v1/completions", {"prompt": "a", "max_tokens": 1}), ("/tokenize", {"prompt": "a"}),
                        ("/detokenize", {"tokens": [5]})):
        assert client.post(route, json={**body, "model": "m"}).status_code == 200, route
        assert client.post(route, json=body).status_code == 200, route
        reply = client.post(route, json={**body, "model": "another"})
        assert reply.status_code == 404 and reply.json()["error"]["param"] == "model", route


def test_ignore_eos_runs_past_the_eos(client, offline):
    llm, _ = offline
    eos = llm.engine.eos_token_ids[0]
    ended = _chat(client, max_tokens=3, temperature=0, allowed_token_ids=[eos], return_token_ids=True).json()
    assert ended["choices"][0]["token_ids"] == [eos] and ended["choices"][0]["finish_reason"] == "stop"
    kept = _chat(client, max_tokens=3, temperature=0, allowed_token_ids=[eos], return_token_ids=True,
                 ignore_eos=True).json()
    assert kept["choices"][0]["token_ids"] == [eos] * 3 and kept["choices"][0]["finish_reason"] == "length"


def test_tokenize_fields(client):
    """/tokenize: add_special_tokens false is what the routes do (the demo tokenizer adds no special token
    either way), true with messages is refused; mm_processor_kwargs reshape the pictures as they do for
    generation."""
    plain = client.post("/tokenize", json={"prompt": "Hello"}).json()
    assert client.post("/tokenize", json={"prompt": "Hello", "add_special_tokens": True}).json() == plain
    assert client.post("/tokenize", json={"prompt": "Hello", "add_special_tokens": False}).json() == plain
    hello = [{"role": "user", "content": "Hello"}]
    _refused(client.post("/tokenize", json={"messages": hello, "add_special_tokens": True}), "add_special_tokens")
    uri = _png_uri(200, 160)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}}]}]
    full = client.post("/tokenize", json={"messages": messages}).json()["count"]
    small = client.post("/tokenize", json={"messages": messages,
                                           "mm_processor_kwargs": {"max_pixels": 56 * 56}}).json()["count"]
    assert small < full
