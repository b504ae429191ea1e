"""Speculative decoding (n-gram prompt lookup, and a draft model: the target with layers removed, or perturbed so
it agrees only sometimes) on tiny Qwen2-VL and Qwen2.5-VL checkpoints: sampled answers keep the target's
distribution (a chi-square test that rejects a planted bug in the rejection sampler); greedy outputs are token
for token those of speculation off — in batches with images, in small prefill chunks, with the prefix cache hit
twice, with n > 1, a stop string or max_tokens inside an accepted run, under preemption, beside requests that
do not speculate (logprobs, sampling, a grammar) whose outputs are unchanged too; drafts are proposed and
accepted (vLLM's counters, also on /metrics); nothing leaks after heavy rejection; invalid configs stop
start-up naming the key."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from fastapi.testclient import TestClient

from mmserve import LLM, ConfigError, SamplingParams, StructuredOutputsParams
from mmserve.engine.async_engine import AsyncEngine
from mmserve.entrypoints.openai.media import MediaRules
from mmserve.entrypoints.openai.server import build_app
from mmserve.entrypoints.openai.serving import ServerConfig
from mmserve.runner import speculation
from testkit.conversations import parity_workload
from testkit.drafters import truncated_copy

# drafts at any batch size (the default cutoff, 8 running requests, would keep the batches below from drafting)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": None}
TEMPERATURE = 0.1
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
REPEATING = ["a b c a b c a b c a b", "one two three one two three one", "x y x y x y x y"]


METHODS = ["ngram", "draft_model"]


@pytest.fixture(scope="module")
def drafters(all_checkpoints, tmp_path_factory):
    """family -> (a draft model that agrees with the target about a third of the time: its layers perturbed,
    the target with its second layer removed: almost never)."""
    root = tmp_path_factory.mktemp("drafters")
    return {family: (truncated_copy(all_checkpoints[family], root / f"{family}-perturbed", 2, noise=0.1),
                     truncated_copy(all_checkpoints[family], root / f"{family}-one-layer", 1))
            for family in ("qwen2_vl", "qwen2_5_vl")}


def _config(method: str, drafters, family: str = "qwen2_vl", **changes) -> dict:
    config = NGRAM if method == "ngram" else {"method": "draft_model", "model": str(drafters[family][0]),
                                               "num_speculative_tokens": 3, "disable_by_batch_size": None}
    return {**config, **changes}


def _tokens(outputs) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


def _run(model_dir, call, config=NGRAM, **engine_args):
    """(speculation off, speculation on) results of `call(llm)`, each engine checked for leaks after."""
    results = []
    for extra in ({}, {"speculative_config": config}):
        with LLM(str(model_dir), num_kv_blocks=256, **engine_args, **extra) as llm:
            results.append(call(llm))
            llm.check_integrity()
            if extra:
                stats = llm.get_stats()
    return results[0], results[1], stats


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_greedy_outputs_are_unchanged_with_images_chunks_and_prefix_hits(all_checkpoints, drafters, family, method):
    conversations = parity_workload(family)[:8]

    def call(llm):
        first = llm.chat(conversations, GREEDY, use_tqdm=False)
        again = llm.chat(conversations[3:6], GREEDY, use_tqdm=False)  # the prefix cache hit, twice
        twice = llm.chat(conversations[3:6], GREEDY, use_tqdm=False)
        text = llm.generate(REPEATING, GREEDY, use_tqdm=False)
        return _tokens(first) + _tokens(again) + _tokens(twice) + _tokens(text)

    off, on, stats = _run(all_checkpoints[family], call, _config(method, drafters, family), max_num_batched_tokens=32)
    assert on == off
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]
    assert stats["spec_decode_num_accepted_tokens_per_pos_0"] >= stats["spec_decode_num_accepted_tokens_per_pos_1"]


@pytest.mark.parametrize("method", METHODS)
def test_stops_inside_an_accepted_run_n_choices_and_other_requests(all_checkpoints, drafters, method):
    model_dir = all_checkpoints["qwen2_vl"]
    with LLM(str(model_dir), num_kv_blocks=256) as plain:
        reference = plain.generate(REPEATING[0], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = reference[len(reference) // 2:len(reference) // 2 + 3]  # a stop string in the middle of the answer
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = [
        SamplingParams(temperature=0, max_tokens=24, stop=[stop]),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),  # max_tokens inside a run
        SamplingParams(temperature=0, max_tokens=12, n=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True),  # each emitted token's logprobs
        SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True),  # no drafts: sampled
        SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(json=schema)),
        # each verified row processed as the sampler would, as if the drafts before it were generated
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.05, frequency_penalty=0.1,
                       presence_penalty=0.05),
        SamplingParams(temperature=0, max_tokens=20, min_tokens=12, bad_words=["b c"], logit_bias={5: 1.5}),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, allowed_token_ids=list(range(60, 200))),
    ]

    def call(llm):
        outputs = llm.generate([REPEATING[0]] * 3 + REPEATING[:3] + REPEATING[:3], params, use_tqdm=False)
        entries = [(e[t].logprob, e[t].rank, *sorted(e)) for c in outputs[3].outputs for t, e in zip(c.token_ids, c.logprobs)]
        return _tokens(outputs), [c.text for o in outputs for c in o.outputs], entries, outputs[3].metrics, \
            [o.metrics.num_draft_tokens for o in outputs[6:]]

    off, on, stats = _run(model_dir, call, _config(method, drafters))
    assert on[:2] == off[:2]
    assert on[0][-1] == off[0][-1]  # the grammar's answer, its drafts checked by the grammar
    # each emitted token's logprob (a verification's row, not a decode's: equal within float rounding), its rank
    # and the top 2, also for the tokens a verification accepted
    assert [e[1:] for e in on[2]] == [e[1:] for e in off[2]]
    assert [e[0] for e in on[2]] == pytest.approx([e[0] for e in off[2]], abs=1e-5)
    assert on[3].num_accepted_tokens > 0
    assert all(on[4])  # the requests with penalties, bans, bias and allowed tokens took drafts
    assert stats["spec_decode_num_accepted_tokens"] > 0
    with LLM(str(model_dir), num_kv_blocks=256, speculative_config=_config(method, drafters)) as llm:
        metrics = llm.generate(REPEATING[1], GREEDY, use_tqdm=False)[0].metrics
        stats = llm.get_stats()
    assert metrics.num_draft_tokens == stats["spec_decode_num_draft_tokens"] > 0  # one request: all of them
    assert metrics.num_accepted_tokens == stats["spec_decode_num_accepted_tokens"]
    assert len(on[1][0]) < len(reference) and stop not in on[1][0]  # the stop string ended it mid-answer


def test_a_grammar_checks_each_draft(all_checkpoints):
    # an answer the grammar makes repeat: its drafts are found and kept, each one checked by the grammar
    regex = "(red|blue|green)( (red|blue|green)){30}"
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex))
    prompts = ["colors: red blue green red blue", "the sky is blue blue blue"]

    def call(llm):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [(c.text, c.token_ids) for o in outputs for c in o.outputs], [o.metrics for o in outputs]

    off, on, stats = _run(all_checkpoints["qwen2_vl"], call)
    assert on[0] == off[0]
    assert all(m.num_accepted_tokens > 0 for m in on[1])
    assert stats["grammar_matchers"] == 0


@pytest.mark.parametrize("method", METHODS)
def test_preemption_and_heavy_rejection_leave_nothing_behind(all_checkpoints, drafters, method):
    model_dir = all_checkpoints["qwen2_5_vl"]
    # drafters that are almost always wrong: the earliest, shortest matches of a prompt full of one token; the
    # target with a layer removed
    prompts = ["z " * 40 + w for w in ("alpha", "beta", "gamma", "delta", "epsilon", "zeta")]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    config = _config(method, drafters, "qwen2_5_vl", num_speculative_tokens=5)
    if method == "draft_model":
        config["model"] = str(drafters["qwen2_5_vl"][1])
    results = []
    for extra in ({}, {"speculative_config": config}):
        with LLM(str(model_dir), num_kv_blocks=24, block_size=16, **extra) as llm:  # too few blocks: preempts
            results.append(_tokens(llm.generate(prompts, params, use_tqdm=False)))
            llm.check_integrity()
            stats = llm.get_stats()
    assert results[1] == results[0]
    assert stats["num_preemptions"] > 0
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"]


@pytest.mark.parametrize("method", [*METHODS, "mtp"])
def test_the_counters_are_on_the_metrics_page(all_checkpoints, drafters, method):
    # the server with each method (mtp: Qwen3.5's own head)
    model_dir = all_checkpoints["qwen3_5" if method == "mtp" else "qwen2_vl"]
    config = {**NGRAM, "method": "mtp"} if method == "mtp" else _config(method, drafters)
    config = {k: v for k, v in config.items() if not (method == "mtp" and k.startswith("prompt_lookup"))}
    llm = LLM(str(model_dir), num_kv_blocks=128, speculative_config=config)
    app = build_app(AsyncEngine(llm.engine), ServerConfig("tiny", MediaRules(llm.engine.config.media)))
    with TestClient(app) as client:
        reply = client.post("/v1/completions", json={"prompt": REPEATING[2], "max_tokens": 16, "temperature": 0,
                                                     "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        page = client.get("/metrics").text
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", 'vllm:spec_decode_num_accepted_tokens_per_pos_total'):
        assert name in page, name
    drafts = next(line for line in page.splitlines() if line.startswith("vllm:spec_decode_num_drafts_total"))
    assert float(drafts.rsplit(" ", 1)[1]) > 0


@pytest.mark.parametrize(("config", "message"), [
    ({"method": "mtp", "num_speculative_tokens": 2}, "has no multi-token-prediction head"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "model": "x"}, "not supported by mmserve yet"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "<="),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model is required with method 'draft_model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "key(s) draft_tensor"),
    ({"method": "unknown", "num_speculative_tokens": 2}, "must be one of"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model is required"),
    ({"model": "DRAFT", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "read by method 'ngram' only"),
    ({"model": "/nonexistent/draft", "num_speculative_tokens": 2}, "cannot be loaded"),
    ({"model": "GEMMA3", "num_speculative_tokens": 2}, "vocabulary of"),
    ({"model": "OTHER_TOKENIZER", "num_speculative_tokens": 2}, "another tokenizer"),
])
def test_invalid_configs_stop_start_up_naming_the_key(all_checkpoints, drafters, tmp_path, config, message):
    target = all_checkpoints["qwen2_vl"]
    if config.get("model") == "OTHER_TOKENIZER":  # the same vocabulary size, two tokens' ids swapped
        other = truncated_copy(target, tmp_path / "other", 2)
        tokenizer = json.loads((other / "tokenizer.json").read_text())
        vocab = tokenizer["model"]["vocab"]
        first, second = list(vocab)[10:12]
        vocab[first], vocab[second] = vocab[second], vocab[first]
        (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    places = {"DRAFT": drafters["qwen2_vl"][0], "GEMMA3": all_checkpoints["gemma3"],
              "OTHER_TOKENIZER": tmp_path / "other"}
    config = {**config, "model": str(places.get(config.get("model"), config.get("model")))} if "model" in config \
        else config
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as raised:
        LLM(str(target), speculative_config=config)
    assert raised.value.key.startswith("speculative_config")


def test_mtp_on_a_checkpoint_without_a_complete_head_stops_start_up(all_checkpoints):
    # the tiny Qwen3.5-MoE checkpoint carries two stray mtp.* tensors, not a head
    with pytest.raises(ConfigError, match="no complete multi-token-prediction head") as raised:
        LLM(str(all_checkpoints["qwen3_5_moe"]), speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert raised.value.key == "speculative_config.method"


def _chi_square_p(first: list, second: list, num_categories: int = 16) -> float:
    """Two-sample chi-square test of homogeneity over the most common outcomes (the rest pooled): p-value."""
    a, b = Counter(first), Counter(second)
    keys = [k for k, _ in (a + b).most_common(num_categories)]
    rows = [[c[k] for k in keys] + [len(s) - sum(c[k] for k in keys)] for c, s in ((a, first), (b, second))]
    columns = [x + y for x, y in zip(*rows) if x + y]
    rows = [[v for v, total in zip(row, map(sum, zip(*rows))) if total] for row in rows]
    n = len(first) + len(second)
    stat = sum((rows[i][j] - size * columns[j] / n) ** 2 / (size * columns[j] / n)
               for i, size in enumerate((len(first), len(second))) for j in range(len(columns)))
    df = torch.tensor((len(columns) - 1) / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(stat / 2.0, dtype=torch.float64)))


def _sampled(model_dir, seed: int, options=None, **engine_args) -> list[tuple[int, ...]]:
    """1500 answers of four tokens, sampled at temperature 0.1 and top-p 0.95 after a prompt that ends in the
    model's own greedy loop (so drafts are proposed at every step and accepted about one time in eight)."""
    with LLM(str(model_dir), num_kv_blocks=512, max_num_seqs=256, seed=seed, **engine_args) as llm:
        loop = llm.generate("hello hello hello hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)[0]
        prompt = {"prompt_token_ids": loop.prompt_token_ids + loop.outputs[0].token_ids}
        params = SamplingParams(max_tokens=4, ignore_eos=True, **(options or {"temperature": TEMPERATURE, "top_p": 0.95}))
        answers = [tuple(o.outputs[0].token_ids) for o in llm.generate([prompt] * 1500, params, use_tqdm=False)]
        if engine_args:
            stats = llm.get_stats()
            assert stats["spec_decode_num_draft_tokens"] > 500 and stats["spec_decode_num_accepted_tokens"] > 50
        llm.check_integrity()
    return answers


def test_sampling_keeps_the_target_distribution_and_a_planted_bug_is_caught(all_checkpoints, drafters, monkeypatch):
    model_dir = all_checkpoints["qwen2_vl"]
    off = _sampled(model_dir, 11)
    assert _chi_square_p(off, _sampled(model_dir, 12, speculative_config=NGRAM)) > 0.01
    assert _chi_square_p(off, _sampled(model_dir, 13, speculative_config=_config("draft_model", drafters))) > 0.01
    # penalties, top-k and min-p: each verified row processed as if the drafts before it were generated
    options = {"temperature": 0.3, "top_k": 20, "min_p": 0.02, "repetition_penalty": 1.1, "presence_penalty": 0.2}
    spec = _config("draft_model", drafters)
    assert _chi_square_p(_sampled(model_dir, 14, options), _sampled(model_dir, 15, options, speculative_config=spec)) > 0.01
    # the bug: a rejected draft replaced by a draw from the whole target, the draft's own mass left in
    monkeypatch.setattr(speculation, "residual", lambda probs, draft: probs.clone())
    assert _chi_square_p(off, _sampled(model_dir, 12, speculative_config=NGRAM)) < 0.01
