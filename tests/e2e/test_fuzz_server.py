"""Fuzzing the HTTP server (seeded, bounded): hypothesis cases — hostile images, data URIs, chat message
structures, sampling fields, completion prompts, raw bodies — against a running `mmserve serve`, and
schemathesis over its own OpenAPI schema, every route. Property: never a 5xx (nor an error event of
type server_error in a stream), always OpenAI's error JSON for a 4xx, never a hang (every call has a
deadline), and the engine healthy and idle after each batch of cases.
"""

from __future__ import annotations

import base64
import io
import json
import time

import httpx
import pytest
import schemathesis
from hypothesis import event, given
from hypothesis import strategies as st
from PIL import Image
from schemathesis.checks import not_a_server_error

from tests.e2e.conftest import running_server
from tests.fixtures.fuzz import (
    chat_messages,
    data_uris,
    fuzz_settings,
    hostile_images,
    json_values,
    processor_kwargs,
    sampling_fields,
)

CASE_DEADLINE_S = 60.0  # one case takes well under a second on the tiny model; a timeout is a hang


@pytest.fixture(scope="module")
def fuzz_server(checkpoint_dirs, tmp_path_factory):
    # a short context bounds generation whatever max_tokens a case asks for; a short fetch timeout bounds
    # a URL that goes nowhere
    with running_server(str(checkpoint_dirs["qwen2_vl"]), tmp_path_factory.mktemp("fuzz") / "server.log",
                        "--max-model-len", "160", "--num-kv-blocks", "64", "--media-fetch-timeout", "2") as server:
        yield server


@pytest.fixture(scope="module")
def http(fuzz_server):
    with httpx.Client(base_url=fuzz_server.url, timeout=CASE_DEADLINE_S) as client:
        yield client


def _check_answer(response: httpx.Response) -> None:
    """The fuzz property for one HTTP answer."""
    assert response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    event(f"status {response.status_code}")
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"], error
        assert " at 0x" not in error["message"], error  # no Python object reprs in what a client reads
        assert error["type"] == "invalid_request_error" or response.status_code in (404, 413), error
        return
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", events[-3:]
        for payload in events[:-1]:
            assert "error" not in json.loads(payload), payload


def _post(http: httpx.Client, path: str, body: object) -> None:
    # Python's encoder writes NaN and Infinity, which strict JSON has not: the server must refuse them with a 400
    _check_answer(http.post(path, content=json.dumps(body), headers={"content-type": "application/json"}))


@pytest.fixture
def idle_after(fuzz_server):
    """After a batch of cases: the server is healthy and its engine idle, with nothing held."""
    yield
    deadline = time.monotonic() + 30
    while True:
        stats = httpx.get(fuzz_server.url + "/v1/stats", timeout=10).json()
        idle = stats["requests_running"] == 0 and stats["requests_waiting"] == 0
        if idle and stats["kv_blocks_free"] == stats["kv_blocks_total"] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert idle and stats["kv_blocks_free"] == stats["kv_blocks_total"], stats
    assert stats["encoder_cache_bytes_referenced"] == 0, stats
    assert httpx.get(fuzz_server.url + "/health", timeout=10).json() == {"status": "ok"}


def _chat_body(messages: object, **fields: object) -> dict:
    return {"messages": messages, "max_tokens": 3, "temperature": 0, **fields}


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 30, 90)).save(buffer, "PNG")
    return buffer.getvalue()


def _ask(url: str) -> list:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is it?"}]}]


@fuzz_settings(100)
@given(data=hostile_images(), stream=st.booleans())
def test_hostile_images(http, idle_after, data, stream):
    _post(http, "/v1/chat/completions",
          _chat_body(_ask("data:image/png;base64," + base64.b64encode(data).decode()), stream=stream))


@fuzz_settings(60)
@given(uri=data_uris())
def test_data_uris(http, idle_after, uri):
    _post(http, "/v1/chat/completions", _chat_body(_ask(uri)))


@fuzz_settings(150)
@given(messages=chat_messages(data_uris() | st.text(max_size=20)), stream=st.booleans())
def test_chat_message_structures(http, idle_after, messages, stream):
    _post(http, "/v1/chat/completions", _chat_body(messages, stream=stream))


@fuzz_settings(80)
@given(kwargs=processor_kwargs, stream=st.booleans())
def test_processor_kwargs(http, idle_after, kwargs, stream):
    png = base64.b64encode(_png()).decode()
    _post(http, "/v1/chat/completions", _chat_body(_ask("data:image/png;base64," + png), stream=stream,
                                                   mm_processor_kwargs=kwargs))


@fuzz_settings(150)
@given(fields=sampling_fields(), stream=st.booleans(), usage=st.booleans())
def test_sampling_fields(http, idle_after, fields, stream, usage):
    body = {"messages": [{"role": "user", "content": "Count to three."}], "stream": stream,
            "stream_options": {"include_usage": usage} if stream else None, **fields}
    _post(http, "/v1/chat/completions", body)


completion_prompts = (st.text(max_size=60) | st.lists(st.integers(-(2**40), 2**40), max_size=8)
                      | st.lists(st.integers(0, 200), min_size=1, max_size=8) | st.lists(st.text(max_size=8), max_size=3)
                      | json_values)


@fuzz_settings(100)
@given(prompt=completion_prompts, media=st.none() | st.lists(json_values | st.fixed_dictionaries(
    {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": data_uris()})}), max_size=2),
    fields=sampling_fields())
def test_completion_prompts(http, idle_after, prompt, media, fields):
    _post(http, "/v1/completions", {"prompt": prompt, "media": media, "max_tokens": 3, **fields})


@fuzz_settings(80)
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
       body=st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()),
       content_type=st.sampled_from(["application/json", "text/plain", "", "application/x-www-form-urlencoded"]))
def test_raw_bodies(http, idle_after, path, body, content_type):
    _check_answer(http.post(path, content=body, headers={"content-type": content_type}))


# ---- schemathesis: every route of the server's own OpenAPI schema --------------------------------------
GROUNDED = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "Count to three."}]},
            "/v1/completions": {"prompt": "Count to three.", "media": None}}


def _grounded(path: str, model: str):
    """Half of the cases keep schemathesis' fields but name the served model and carry a usable prompt,
    so its sampling values, stream flags and extras reach the engine instead of all stopping at the
    first 400 (an unknown model, a message without a role)."""
    def ground(drawn):
        case, use_model, use_prompt = drawn
        if isinstance(case.body, dict):
            if use_model:
                case.body["model"] = model
            if use_prompt and path in GROUNDED:
                case.body.update(GROUNDED[path])
        return case
    return ground


def test_openapi_schema_every_route(fuzz_server, idle_after):
    # each operation's cases are drawn from the schema the running server publishes (schemathesis'
    # pytest plugin does not run on this pytest, so the operations are walked here)
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"} <= {op.path for op in operations}
    served = httpx.get(fuzz_server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    for operation in operations:
        cases = st.tuples(operation.as_strategy(), st.booleans(), st.booleans()).map(
            _grounded(operation.path, served))

        @fuzz_settings(40)
        @given(case=cases)
        def check(case):
            response = case.call(base_url=fuzz_server.url, timeout=CASE_DEADLINE_S)
            event(f"status {response.status_code}")
            case.validate_response(response, checks=[not_a_server_error])

        try:
            check()
        except Exception as exc:
            raise AssertionError(f"{operation.method.upper()} {operation.path}: {exc}") from exc
