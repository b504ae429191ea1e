"""A fault inside a model step (a `FaultPlan`: the runner raises when the batch holds a chosen token id)
fails the requests of that step with an internal error — 500 on the server — and the engine serves the
others and new ones, with nothing leaked."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from mmserve import LLM, SamplingParams
from mmserve.faults import FaultPlan
from tests.models.helpers import image_part, random_image, text_part, user

GREEDY = SamplingParams(temperature=0, max_tokens=4, min_tokens=4)


@pytest.fixture
def faulty_llm(checkpoint_dirs):
    llm = LLM(str(checkpoint_dirs["qwen2_vl"]))
    fault = llm.engine.processor.tokenizer.encode("zebra")[0]
    return LLM(str(checkpoint_dirs["qwen2_vl"]), faults=FaultPlan(step_fault_token_id=fault)), fault


def test_a_faulted_step_fails_its_requests_and_the_engine_serves_on(faulty_llm):
    import numpy as np

    llm, fault = faulty_llm
    engine = llm.engine
    image = random_image(np.random.default_rng(0), 64, 48)
    fine = engine.process_chat(user(image_part(image), text_part("Describe.")))
    bad = engine.process_chat(user(image_part(image), text_part("zebra")))
    assert fault in bad.prompt_token_ids
    engine.add_request("early", engine.process_chat(user(text_part("Count to ten."))), GREEDY)
    engine.step()  # "early" is past its prefill: it decodes in the faulted step, and fails with it
    engine.add_request("fine", fine, GREEDY)
    engine.add_request("bad", bad, GREEDY)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    for rid in ("early", "fine", "bad"):  # all three ran in the step that raised
        out = outputs[rid]
        assert out.outputs[0].finish_reason == "error" and out.internal_error
        assert "internal error in the model step" in out.error and "test fault" in out.error
    engine.check_integrity()
    # the engine goes on: the same image (its encoder entry was produced in the faulted step) and new requests
    again = llm.chat(user(image_part(image), text_part("Describe.")), GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].finish_reason == "length" and len(again.outputs[0].token_ids) == 4
    llm.check_integrity()
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_the_server_answers_500_and_serves_on(faulty_llm):
    from mmserve.engine.async_engine import AsyncEngine
    from mmserve.entrypoints.openai.media import MediaRules
    from mmserve.entrypoints.openai.server import build_app
    from mmserve.entrypoints.openai.serving import ServerConfig

    llm, _ = faulty_llm
    app = build_app(AsyncEngine(llm.engine), ServerConfig("m", MediaRules(llm.engine.config.media)))
    with TestClient(app) as client:
        body = {"model": "m", "max_tokens": 3, "temperature": 0, "messages": [{"role": "user", "content": "zebra"}]}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 500, response.text
        error = response.json()["error"]
        assert error["type"] == "server_error" and "internal error in the model step" in error["message"]
        assert client.get("/health").status_code == 200
        body["messages"] = [{"role": "user", "content": "hello"}]
        assert client.post("/v1/chat/completions", json=body).status_code == 200
