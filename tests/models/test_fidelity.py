"""Fidelity to transformers where vLLM and transformers agree and mmserve once did not: `min_tokens` bans
every EOS id (generation_config.json's list and the tokenizer's) and every stop id until it is reached,
with or without `ignore_eos` (transformers' min_new_tokens); generation_config.json's sampling defaults
apply where a request leaves a field unset (vLLM's `--generation-config auto`)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import torch

from mmserve import LLM, SamplingParams
from testkit.conversations import parity_workload
from testkit.families import FAMILIES
from tests.models.helpers import reference_inputs

NUM_TOKENS = 12


def _reference_ids(model_dir, family, messages, **generate_kwargs):
    """transformers' greedy ids for one conversation."""
    inputs = reference_inputs(model_dir, family, messages)
    model = FAMILIES[family].reference_class().from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, **generate_kwargs)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _with_generation_config(model_dir, tmp_path, **fields):
    """A copy of the checkpoint whose generation_config.json also sets `fields`."""
    copy = tmp_path / model_dir.name
    shutil.copytree(model_dir, copy)
    path = copy / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**config, **fields}))
    return copy


def _greedy(llm, chat, **fields):
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, **fields)
    return llm.chat([chat], params, use_tqdm=False)[0].outputs[0].token_ids


def test_min_tokens_bans_every_eos_id_also_under_ignore_eos(served_family, served_model_dir, tmp_path):
    """generation_config.json lists as an EOS id a token the greedy answer samples at step 1: ignore_eos
    with min_tokens = max_tokens holds off every EOS id of the list, as transformers' generate(
    min_new_tokens=...) does (and as vLLM's min-tokens processor does)."""
    chat = parity_workload(served_family)[0]
    free = _greedy(LLM(str(served_model_dir)), chat, ignore_eos=True)
    eos_list = [*_listed_eos(served_model_dir), free[1]]
    model_dir = _with_generation_config(served_model_dir, tmp_path, eos_token_id=eos_list)
    llm = LLM(str(model_dir))
    assert free[1] in llm.engine.eos_token_ids
    ids = _reference_ids(model_dir, served_family, chat, max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                         eos_token_id=list(llm.engine.eos_token_ids))
    got = _greedy(llm, chat, min_tokens=NUM_TOKENS, ignore_eos=True)
    assert got == ids
    assert not set(got) & set(llm.engine.eos_token_ids)
    # without ignore_eos the same ids are banned until min_tokens, and one of them ends the answer after it
    ids = _reference_ids(model_dir, served_family, chat, max_new_tokens=NUM_TOKENS, min_new_tokens=3,
                         eos_token_id=list(llm.engine.eos_token_ids))
    assert _greedy(llm, chat, min_tokens=3) == ids
    llm.check_integrity()


def _listed_eos(model_dir):
    path = model_dir / "generation_config.json"
    listed = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    return [] if listed is None else [listed] if isinstance(listed, int) else list(listed)


def test_min_tokens_bans_stop_token_ids_until_reached(all_checkpoints):
    """A stop id the unconstrained greedy answer samples early is banned until min_tokens, then stops
    the request as transformers' generate does with it in its EOS list."""
    family = "qwen2_vl"
    model_dir = all_checkpoints[family]
    chat = parity_workload(family)[0]
    llm = LLM(str(model_dir))
    free = _greedy(llm, chat, ignore_eos=True)
    stop = free[1]  # sampled at step 1: min_tokens 4 must hold it off
    eos = list(llm.engine.eos_token_ids)
    ids = _reference_ids(model_dir, family, chat, max_new_tokens=NUM_TOKENS, min_new_tokens=4,
                         eos_token_id=[*eos, stop])
    got = _greedy(llm, chat, min_tokens=4, stop_token_ids=[stop])
    assert got == ids
    assert stop not in got[:4]


def _server(llm, **server_config):
    from fastapi.testclient import TestClient

    from mmserve.engine.async_engine import AsyncEngine
    from mmserve.entrypoints.openai.media import MediaRules
    from mmserve.entrypoints.openai.server import build_app
    from mmserve.entrypoints.openai.serving import ServerConfig

    config = ServerConfig("m", MediaRules(llm.engine.config.media), **server_config)
    return TestClient(build_app(AsyncEngine(llm.engine), config))


def test_generation_config_sampling_defaults_apply_where_a_request_leaves_them_unset(all_checkpoints, tmp_path):
    """A checkpoint whose generation_config.json sets repetition_penalty 1.8: a greedy request that leaves
    repetition_penalty unset answers as transformers' generate (which applies the file's), offline through
    get_default_sampling_params and on the server; an explicit value wins; --generation-config vllm drops
    the defaults."""
    family = "qwen2_vl"
    model_dir = _with_generation_config(all_checkpoints[family], tmp_path, repetition_penalty=1.8)
    chat = parity_workload(family)[0]
    expected = _reference_ids(model_dir, family, chat, max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS)
    plain = _greedy(LLM(str(model_dir), generation_config="vllm"), chat, min_tokens=NUM_TOKENS)
    assert plain != expected, "the penalty changes nothing on this prompt: the test could not fail"
    llm = LLM(str(model_dir))
    defaults = llm.get_default_sampling_params()
    assert defaults.repetition_penalty == 1.8
    assert LLM(str(model_dir), generation_config="vllm").get_default_sampling_params() == SamplingParams()
    greedy = dataclasses.replace(defaults, temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
    assert llm.chat([chat], greedy, use_tqdm=False)[0].outputs[0].token_ids == expected
    body = {"model": "m", "messages": chat, "temperature": 0, "max_tokens": NUM_TOKENS, "min_tokens": NUM_TOKENS,
            "return_token_ids": True}
    with _server(llm) as client:
        unset = client.post("/v1/chat/completions", json=body)
        explicit = client.post("/v1/chat/completions", json={**body, "repetition_penalty": 1.0})
    assert unset.status_code == 200 and explicit.status_code == 200, unset.text + explicit.text
    assert unset.json()["choices"][0]["token_ids"] == expected
    assert explicit.json()["choices"][0]["token_ids"] == plain
    llm.check_integrity()
