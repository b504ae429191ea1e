"""The pooling routes in process (the app over an AsyncEngine run with runner="pooling", FastAPI's TestClient) on
a tiny Qwen3-VL checkpoint: /v1/embeddings in every input form equals the offline `LLM.embed`, float and base64
alike, with dimensions, the activation, truncation, messages with an image; /v1/score in its three spellings
and /rerank, /v1/rerank, /v2/rerank agree with the offline `LLM.score` (cosine for an embedding model; a
reranker's relevance, through a score template for a pair with an image); each runner's routes are a 400
naming the other runner; every malformed body is a 400 naming its field."""

from __future__ import annotations

import base64
import io
import struct

import numpy as np
import pytest
from fastapi.testclient import TestClient

from mmserve import LLM, PoolingParams
from mmserve.engine.async_engine import AsyncEngine
from mmserve.entrypoints.openai.media import MediaRules
from mmserve.entrypoints.openai.server import build_app
from mmserve.entrypoints.openai.serving import ServerConfig
from testkit.conversations import random_image

TEXTS = ["hello world", "a red square on blue", "the quick brown fox " * 10]
NO_TOKEN, YES_TOKEN = "a", "b"  # the tiny vocabulary has no single-token "no" and "yes"
RERANKER = {"classifier_from_token": [NO_TOKEN, YES_TOKEN], "is_original_qwen3_reranker": True}
# a score template over vLLM's "query" and "document" messages, text and pictures alike
SCORE_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the Query. Answer yes or no.<|im_end|>\n<|im_start|>user\n"
    "{% for m in messages %}<{{ m.role }}>: {% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'text' %}{{ p.text }}{% else %}<|vision_start|><|image_pad|>"
    "<|vision_end|>{% endif %}{% endfor %}{% endif %}\n{% endfor %}<|im_end|>\n<|im_start|>assistant\n")


def _data_uri(seed: int) -> str:
    buffer = io.BytesIO()
    random_image(np.random.default_rng(seed), 64, 48).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _serve(llm: LLM):
    app = build_app(AsyncEngine(llm.engine), ServerConfig("tiny", MediaRules(llm.engine.config.media)))
    return TestClient(app)


@pytest.fixture(scope="module")
def ckpt(all_checkpoints):
    return all_checkpoints["qwen3_vl"]


@pytest.fixture(scope="module")
def offline(ckpt):
    """The offline reference: an engine of its own (the served one steps on the server's thread)."""
    return LLM(str(ckpt), runner="pooling", num_kv_blocks=128)


@pytest.fixture(scope="module")
def client(ckpt):
    served = LLM(str(ckpt), runner="pooling", num_kv_blocks=128)
    with _serve(served) as test_client:
        yield test_client
    served.check_integrity()


@pytest.fixture(scope="module")
def reranker(ckpt, tmp_path_factory):
    template = tmp_path_factory.mktemp("score") / "score.jinja"
    template.write_text(SCORE_TEMPLATE)
    served, offline = (LLM(str(ckpt), runner="pooling", hf_overrides=RERANKER, chat_template=str(template),
                           num_kv_blocks=128) for _ in range(2))
    with _serve(served) as test_client:
        yield test_client, offline
    served.check_integrity()


def _post(client, path, **body):
    reply = client.post(path, json={"model": "tiny", **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def _refused(client, path, field, **body):
    reply = client.post(path, json={"model": "tiny", **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field, reply.json()
    return reply.json()["error"]["message"]


def _vectors(reply) -> list[list[float]]:
    out = []
    for item in sorted(reply["data"], key=lambda d: d["index"]):
        value = item["embedding"]
        if isinstance(value, str):
            raw = base64.b64decode(value)
            value = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        out.append(value)
    return out


def test_embeddings_in_every_input_form_equal_the_offline_ones(client, offline):
    expected = [o.outputs.embedding for o in offline.embed(TEXTS, use_tqdm=False)]
    ids = [offline.engine.processor.tokenizer.encode(t) for t in TEXTS]
    for given in (TEXTS, ids):
        np.testing.assert_allclose(_vectors(_post(client, "/v1/embeddings", input=given)), expected, atol=1e-5)
    one = _post(client, "/v1/embeddings", input=TEXTS[0], user="someone")
    np.testing.assert_allclose(_vectors(one)[0], expected[0], atol=1e-5)
    np.testing.assert_allclose(_vectors(_post(client, "/v1/embeddings", input=ids[1]))[0], expected[1], atol=1e-5)
    coded = _post(client, "/v1/embeddings", input=TEXTS, encoding_format="base64")
    np.testing.assert_allclose(_vectors(coded), expected, atol=1e-6)
    assert one["usage"] == {"prompt_tokens": len(ids[0]), "total_tokens": len(ids[0])}
    assert one["object"] == "list" and one["data"][0]["object"] == "embedding"


def test_dimensions_activation_and_truncation(client, offline):
    short = _vectors(_post(client, "/v1/embeddings", input=TEXTS[1], dimensions=8))[0]
    np.testing.assert_allclose(short, offline.embed(TEXTS[1], PoolingParams(dimensions=8), use_tqdm=False)[0]
                               .outputs.embedding, atol=1e-5)
    raw = offline.embed(TEXTS[1], PoolingParams(use_activation=False), use_tqdm=False)[0].outputs.embedding
    for field in ("use_activation", "normalize"):
        got = _vectors(_post(client, "/v1/embeddings", input=TEXTS[1], **{field: False}))[0]
        np.testing.assert_allclose(got, raw, atol=1e-5)
    cut = _post(client, "/v1/embeddings", input=TEXTS[2], truncate_prompt_tokens=5)
    tail = offline.engine.processor.tokenizer.encode(TEXTS[2])[-5:]
    expected = offline.embed({"prompt_token_ids": tail}, use_tqdm=False)[0].outputs.embedding
    np.testing.assert_allclose(_vectors(cut)[0], expected, atol=1e-5)
    assert cut["usage"]["prompt_tokens"] == 5
    assert "larger than the model" in _refused(client, "/v1/embeddings", "dimensions", input="x", dimensions=10_000)


def test_messages_with_an_image_embed_as_the_rendered_chat(client, offline):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_uri(1)}},
                                             {"type": "text", "text": "what is this?"}]}]
    served = _vectors(_post(client, "/v1/embeddings", messages=messages))[0]
    with_prompt = _vectors(_post(client, "/v1/embeddings", messages=messages, add_generation_prompt=True))[0]
    kwargs = _vectors(_post(client, "/v1/embeddings", messages=messages,
                            mm_processor_kwargs={"min_pixels": 128 * 128, "max_pixels": 256 * 256}))[0]
    continued = _post(client, "/v1/embeddings", messages=messages + [{"role": "assistant", "content": "a pic"}],
                      continue_final_message=True)
    numbered = _post(client, "/v1/embeddings", messages=messages, chat_template_kwargs={"add_vision_id": True})
    assert served != with_prompt and served != kwargs and _vectors(continued)[0] != served
    assert numbered["usage"]["prompt_tokens"] > _post(client, "/v1/embeddings", messages=messages)["usage"][
        "prompt_tokens"]  # "Picture 1:" before the picture
    frontend = offline.engine.frontend
    from mmserve.entrypoints.openai.media import resolve_messages

    resolved = resolve_messages(messages, MediaRules(offline.engine.config.media))
    chat = frontend.processor.render_chat(resolved, add_generation_prompt=False)
    expected = offline.embed({"prompt": chat.prompt, "multi_modal_data": {"image": chat.images}}, use_tqdm=False)
    np.testing.assert_allclose(served, expected[0].outputs.embedding, atol=1e-5)


def test_score_and_rerank_spellings_agree_with_the_offline_cosine(client, offline):
    expected = [o.outputs.score for o in offline.score(TEXTS[0], TEXTS, use_tqdm=False)]
    for first, second in (("data_1", "data_2"), ("text_1", "text_2"), ("queries", "documents")):
        reply = _post(client, "/v1/score", **{first: TEXTS[0], second: TEXTS})
        np.testing.assert_allclose([d["score"] for d in reply["data"]], expected, atol=1e-5)
    assert _post(client, "/score", data_1=TEXTS[0], data_2=TEXTS[1])["data"][0]["object"] == "score"
    order = sorted(range(3), key=lambda i: -expected[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        reply = _post(client, path, query=TEXTS[0], documents=TEXTS, top_n=2)
        assert [r["index"] for r in reply["results"]] == order[:2]
        assert reply["results"][0]["document"] == {"text": TEXTS[order[0]]}
        np.testing.assert_allclose([r["relevance_score"] for r in reply["results"]],
                                   [expected[i] for i in order[:2]], atol=1e-5)
    bare = _post(client, "/v1/rerank", query=TEXTS[0], documents=TEXTS, return_documents=False)
    assert len(bare["results"]) == 3 and all("document" not in r for r in bare["results"])


def test_a_reranker_scores_pairs_through_its_score_template(reranker):
    client, llm = reranker
    documents = ["a red square", {"content": [{"type": "image_url", "image_url": {"url": _data_uri(2)}},
                                              {"type": "text", "text": "a photo"}]}]
    reply = _post(client, "/v1/rerank", query="what is red?", documents=documents, use_activation=True)
    scores = {r["index"]: r["relevance_score"] for r in reply["results"]}
    expected = llm.score("what is red?", documents[0], use_tqdm=False)[0].outputs.score
    assert abs(scores[0] - expected) < 1e-6 and 0.0 < scores[1] < 1.0
    logits = _post(client, "/v1/score", data_1="what is red?", data_2=documents[0], use_activation=False)
    assert abs(1 / (1 + np.exp(-logits["data"][0]["score"])) - expected) < 1e-6
    assert "reranker" in _refused(client, "/v1/embeddings", "input", input="x")
    bad = {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
    _refused(client, "/v1/rerank", "documents[1].content[0].image_url", query="q", documents=["ok", bad])


def test_each_runner_refuses_the_other_runners_routes(client, all_checkpoints):
    reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 400 and "--runner generate" in reply.json()["error"]["message"]
    generating = LLM(str(all_checkpoints["qwen3_vl"]), num_kv_blocks=64)
    with _serve(generating) as test_client:
        for path in ("/v1/embeddings", "/v1/score", "/v1/rerank", "/rerank", "/v2/rerank", "/score"):
            reply = test_client.post(path, json={"input": "x"})
            assert reply.status_code == 400 and "--runner pooling" in reply.json()["error"]["message"], path


def test_malformed_bodies_are_400s_naming_the_field(client):
    _refused(client, "/v1/embeddings", "input", input="x", messages=[{"role": "user", "content": "y"}])
    _refused(client, "/v1/embeddings", "input", input=[])
    _refused(client, "/v1/embeddings", "encoding_format", input="x", encoding_format="int8")
    _refused(client, "/v1/embeddings", "truncate_prompt_tokens", input="x", truncate_prompt_tokens=-2)
    _refused(client, "/v1/embeddings", "dimensions", input="x", dimensions=0)
    _refused(client, "/v1/embeddings", "unknown_field", input="x", unknown_field=1)
    _refused(client, "/v1/score", "data_1", data_1=TEXTS[:2], data_2=TEXTS)
    _refused(client, "/v1/score", "data_1", data_1="x")
    _refused(client, "/v1/rerank", "documents", query="x", documents=[])
    _refused(client, "/v1/rerank", "top_n", query="x", documents=["y"], top_n=-1)
    _refused(client, "/v1/rerank", "documents[0]", query="x", documents=[{"text": "no content list"}])
    assert client.post("/v1/embeddings", json={"model": "other", "input": "x"}).status_code == 404
