"""The pooling runner end to end: a real `mmserve serve --runner pooling` of the bundled demo model (one for
the module) driven by the official `openai` SDK's `embeddings.create` (its default, base64, which it decodes,
and `encoding_format="float"`; Matryoshka `dimensions`; an oversized `dimensions` as the SDK's
`BadRequestError`), and vLLM's /v1/score and the rerank routes (/rerank, /v1/rerank, /v2/rerank) over httpx.
Vectors are checked against the offline `LLM(runner="pooling").embed` of the same texts in this process, and
scores against the cosine of those vectors. A generating server (the default runner) refuses the pooling
routes naming `--runner pooling`; the pooling server refuses chat naming `--runner generate`. Both servers
must stop on SIGTERM with exit status 0."""

from __future__ import annotations

import base64
import math
import struct

import httpx
import openai
import pytest
from openai import OpenAI

from mmserve import LLM
from mmserve.config import DEMO_MODEL_NAME
from tests.e2e.conftest import start_server, stop_server, wait_healthy

TEXTS = ["a", "b c"]
QUERY = "How many red shapes are there?"
DOCUMENTS = ["There are two red shapes.", "blue green blue green", "A red circle and a red square."]
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")
SCORE_PATHS = ("/score", "/v1/score")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{"pooling": `--runner pooling`, "generate": the default runner}, both the demo model, started together;
    each must exit 0 on SIGTERM at the end of the module."""
    logs = tmp_path_factory.mktemp("embeddings")
    running = {"pooling": start_server(None, logs / "pooling.log", "--runner", "pooling"),
               "generate": start_server(None, logs / "generate.log")}
    try:
        for server in running.values():
            wait_healthy(server)
        yield running
    finally:
        for server in running.values():
            stop_server(server)
    for name, server in running.items():
        assert server.process.returncode == 0, f"{name} server exited with {server.process.returncode}:\n" \
                                               f"{server.log()}"
        assert "Traceback" not in server.log(), f"{name} server:\n{server.log()}"


@pytest.fixture(scope="module")
def pooling_server(servers):
    return servers["pooling"]


@pytest.fixture(scope="module")
def generating_server(servers):
    return servers["generate"]


@pytest.fixture(scope="module")
def client(pooling_server):
    return OpenAI(base_url=pooling_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline():
    """text -> the offline embedding of it (the same demo model, loaded in this process)."""
    llm = LLM(runner="pooling")
    texts = [*TEXTS, QUERY, *DOCUMENTS]
    return {text: list(o.outputs.embedding) for text, o in zip(texts, llm.embed(texts, use_tqdm=False))}


def norm(vector) -> float:
    return math.sqrt(math.fsum(v * v for v in vector))


def cosine(a, b) -> float:
    return math.fsum(x * y for x, y in zip(a, b)) / (norm(a) * norm(b))


def assert_close(got, expected, tolerance: float) -> None:
    assert len(got) == len(expected)
    worst = max(abs(g - e) for g, e in zip(got, expected))
    assert worst <= tolerance, f"largest difference {worst}"


def test_the_sdk_embeds_as_the_offline_llm_in_base64_and_float(client, offline):
    base64_default = client.embeddings.create(model=DEMO_MODEL_NAME, input=TEXTS)  # the SDK asks for base64
    as_float = client.embeddings.create(model=DEMO_MODEL_NAME, input=TEXTS, encoding_format="float",
                                        user="e2e-user")
    for response in (base64_default, as_float):
        assert response.object == "list" and response.model == DEMO_MODEL_NAME
        assert [d.index for d in response.data] == [0, 1]
        assert all(d.object == "embedding" for d in response.data)
        for data, text in zip(response.data, TEXTS):
            assert isinstance(data.embedding, list)
            assert_close(data.embedding, offline[text], 1e-6)
            assert abs(norm(data.embedding) - 1) < 1e-5
        assert response.usage.prompt_tokens > 0 and response.usage.total_tokens == response.usage.prompt_tokens
    assert base64_default.usage.prompt_tokens == as_float.usage.prompt_tokens


def test_base64_on_the_wire_is_little_endian_float32(pooling_server, offline):
    response = httpx.post(pooling_server.url + "/v1/embeddings", timeout=120, json={
        "model": DEMO_MODEL_NAME, "input": TEXTS, "encoding_format": "base64"})
    assert response.status_code == 200, response.text
    for data, text in zip(response.json()["data"], TEXTS):
        raw = base64.b64decode(data["embedding"])
        assert len(raw) == 4 * len(offline[text])
        assert_close(struct.unpack(f"<{len(raw) // 4}f", raw), offline[text], 1e-6)


def test_matryoshka_dimensions_truncate_then_renormalize(client, offline):
    # the SDK's default (base64, which it decodes: it leaves a base64 the caller asked for as the string) and float
    for encoding in ({}, {"encoding_format": "float"}):
        response = client.embeddings.create(model=DEMO_MODEL_NAME, input=TEXTS, dimensions=8, **encoding)
        for data, text in zip(response.data, TEXTS):
            head = offline[text][:8]
            expected = [v / norm(head) for v in head]
            assert len(data.embedding) == 8 and abs(norm(data.embedding) - 1) < 1e-5
            assert_close(data.embedding, expected, 1e-6)


def test_dimensions_larger_than_the_hidden_size_are_a_bad_request(client, offline):
    hidden_size = len(offline[TEXTS[0]])
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=DEMO_MODEL_NAME, input="a", dimensions=hidden_size + 1)
    assert refused.value.status_code == 400
    assert "dimensions" in refused.value.body["message"]
    assert refused.value.body.get("param") == "dimensions"


def test_rerank_sorts_documents_by_the_cosine_of_their_embeddings(pooling_server, offline):
    expected = [cosine(offline[QUERY], offline[d]) for d in DOCUMENTS]
    best_first = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    answers = {}
    for path in RERANK_PATHS:
        response = httpx.post(pooling_server.url + path, json={"model": DEMO_MODEL_NAME, "query": QUERY,
                                                               "documents": DOCUMENTS}, timeout=120)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["model"] == DEMO_MODEL_NAME and body["usage"]["prompt_tokens"] > 0 and body["id"]
        results = body["results"]
        assert [r["index"] for r in results] == best_first
        scores = [r["relevance_score"] for r in results]
        assert scores == sorted(scores, reverse=True)
        for result in results:
            assert abs(result["relevance_score"] - expected[result["index"]]) <= 1e-5
            assert result["document"] == {"text": DOCUMENTS[result["index"]]}
        answers[path] = (results, body["usage"])
    first = answers[RERANK_PATHS[0]]
    for path in RERANK_PATHS[1:]:
        got, want = answers[path], first
        assert [r["index"] for r in got[0]] == [r["index"] for r in want[0]] and got[1] == want[1], path
        assert_close([r["relevance_score"] for r in got[0]], [r["relevance_score"] for r in want[0]], 1e-6)


def test_rerank_top_n_keeps_the_best(pooling_server, offline):
    expected = [cosine(offline[QUERY], offline[d]) for d in DOCUMENTS]
    best_first = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    for path in RERANK_PATHS:
        response = httpx.post(pooling_server.url + path, timeout=120, json={
            "model": DEMO_MODEL_NAME, "query": QUERY, "documents": DOCUMENTS, "top_n": 2,
            "return_documents": False})
        assert response.status_code == 200, response.text
        results = response.json()["results"]
        assert [r["index"] for r in results] == best_first[:2], path
        assert all("document" not in r or r["document"] is None for r in results)
        for result in results:
            assert abs(result["relevance_score"] - expected[result["index"]]) <= 1e-5


@pytest.mark.parametrize("path", SCORE_PATHS)
def test_score_is_the_cosine_of_the_offline_embeddings(pooling_server, offline, path):
    expected = [cosine(offline[QUERY], offline[d]) for d in DOCUMENTS]
    spellings = [{"data_1": QUERY, "data_2": DOCUMENTS}, {"text_1": QUERY, "text_2": DOCUMENTS},
                 {"queries": QUERY, "documents": DOCUMENTS}]
    for sides in spellings:
        response = httpx.post(pooling_server.url + path, json={"model": DEMO_MODEL_NAME, **sides}, timeout=120)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["object"] == "list" and body["model"] == DEMO_MODEL_NAME
        assert body["usage"]["prompt_tokens"] > 0
        assert [(d["index"], d["object"]) for d in body["data"]] == [(i, "score") for i in range(len(DOCUMENTS))]
        assert_close([d["score"] for d in body["data"]], expected, 1e-5)
    # pairwise: as many first entries as second ones
    pairwise = httpx.post(pooling_server.url + path, timeout=120, json={
        "model": DEMO_MODEL_NAME, "data_1": [QUERY, DOCUMENTS[0]], "data_2": [DOCUMENTS[1], DOCUMENTS[2]]})
    assert pairwise.status_code == 200, pairwise.text
    assert_close([d["score"] for d in pairwise.json()["data"]],
                 [cosine(offline[QUERY], offline[DOCUMENTS[1]]),
                  cosine(offline[DOCUMENTS[0]], offline[DOCUMENTS[2]])], 1e-5)


def test_a_generating_server_refuses_the_pooling_routes_naming_the_runner(generating_server):
    bodies = {"/v1/embeddings": {"input": "a"}, "/v1/score": {"data_1": QUERY, "data_2": DOCUMENTS},
              "/score": {"data_1": QUERY, "data_2": DOCUMENTS},
              **{path: {"query": QUERY, "documents": DOCUMENTS} for path in RERANK_PATHS}}
    for path, body in bodies.items():
        response = httpx.post(generating_server.url + path, json={"model": DEMO_MODEL_NAME, **body}, timeout=60)
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert "--runner pooling" in error["message"], (path, error)
        assert error["type"] == "invalid_request_error"
    sdk = OpenAI(base_url=generating_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.embeddings.create(model=DEMO_MODEL_NAME, input=TEXTS)
    assert "--runner pooling" in refused.value.body["message"]


def test_a_pooling_server_refuses_chat_naming_the_runner(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=DEMO_MODEL_NAME, max_tokens=4,
                                       messages=[{"role": "user", "content": "How many shapes are there?"}])
    assert "--runner generate" in refused.value.body["message"]
