"""Speculative decoding on a hybrid model (Qwen3.5's Gated DeltaNet layers keep a recurrent state, not KV): a
verification writes every draft into the state, and the runner puts back the state after the last kept token.
The drafts come from an oracle that knows speculation off's answers and spoils some of them (the tiny random
model's answers never repeat, so prompt lookup alone would propose nothing it accepts): every number of kept
drafts, 0 to all, occurs, and the greedy answers, with chunked prefill and the prefix cache hit twice, are
token for token speculation off's; nothing leaks."""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.core import drafts

PROMPTS = [" ".join([p] * 4) for p in ["a b c a b c a b c a b", "one two three one two three one", "x y x y x y x y",
                                     "the red circle is left"]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
CONFIG = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
          "disable_by_batch_size": None}


def _answers(llm) -> list[list[int]]:
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    again = llm.generate(PROMPTS[1:3], GREEDY, use_tqdm=False)  # the prefix cache, hit twice
    twice = llm.generate(PROMPTS[1:3], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in first + again + twice]


def _oracle(prompts: list[list[int]], answers: list[list[int]]):
    """A lookup that proposes the answer's continuation, with the n-th proposal's draft n % 4 spoiled (n % 4 == 3:
    none spoiled): a verification keeps 0, 1, 2 or all 3 drafts in turn."""
    calls = []

    def lookup(tokens, lookup_min, lookup_max, k):
        for prompt, answer in zip(prompts, answers):
            if tokens[:len(prompt)] == prompt:
                proposal = answer[len(tokens) - len(prompt):len(tokens) - len(prompt) + k]
                spoil = len(calls) % 4
                if spoil < len(proposal):
                    proposal[spoil] = (proposal[spoil] + 1) % 100
                calls.append(len(proposal))
                return tuple(proposal)
        return ()
    return lookup


ENGINE = {"num_kv_blocks": 256, "max_num_batched_tokens": 32, "block_size": 16}  # chunked prefill, prefix hits
MTP = {"method": "mtp", "num_speculative_tokens": 3, "disable_by_batch_size": None}


@pytest.fixture(scope="module")
def speculation_off(all_checkpoints):
    """(the prompts' token ids, the answers without speculation)."""
    with LLM(str(all_checkpoints["qwen3_5"]), **ENGINE) as llm:
        answers = _answers(llm)
        prompt_ids = [list(o.prompt_token_ids)
                      for o in llm.generate(PROMPTS, SamplingParams(max_tokens=1), use_tqdm=False)]
    return prompt_ids, answers


def _speculating(model_dir, config) -> tuple[list[list[int]], dict]:
    """The answers with speculation, and the engine's stats; nothing left behind."""
    with LLM(str(model_dir), **ENGINE, speculative_config=config) as llm:
        answers = _answers(llm)
        stats = llm.get_stats()
        llm.check_integrity()
    return answers, stats


def test_a_hybrid_models_state_takes_back_rejected_drafts(all_checkpoints, speculation_off, monkeypatch):
    prompt_ids, off = speculation_off
    monkeypatch.setattr(drafts, "lookup", _oracle(prompt_ids, off[:len(PROMPTS)]))
    on, stats = _speculating(all_checkpoints["qwen3_5"], CONFIG)
    assert on == off
    assert stats["prefix_cache_hit_tokens"] > 0
    accepted = [stats[f"spec_decode_num_accepted_tokens_per_pos_{i}"] for i in range(3)]
    assert stats["spec_decode_num_drafts"] > accepted[0] > accepted[1] > accepted[2] > 0


def test_mtp_drafts_from_the_checkpoints_head_and_answers_are_unchanged(all_checkpoints, speculation_off):
    on, stats = _speculating(all_checkpoints["qwen3_5"], MTP)
    assert on == speculation_off[1]
    assert stats["spec_decode_num_draft_tokens"] >= 3 * stats["spec_decode_num_drafts"] * 0.9 > 0


def _reference_mtp_drafts(model_dir, prompt_ids: list[int], first: int, k: int) -> list[int]:
    """The head as the hub's checkpoints mean it (vLLM's Qwen3.5 MTP): at position t, fc(norm_e(embed(x[t+1])) ++
    norm_h(h[t])) through one full-attention decoder layer (transformers' own) and a norm, the target's LM head
    on it; each draft fed back with the head's output as its hidden state. Recomputed causally from scratch."""
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen3_5ForConditionalGeneration
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    target = Qwen3_5ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    text = target.config.text_config
    tensors = {k[4:]: v for k, v in load_file(model_dir / "model.safetensors").items() if k.startswith("mtp.")}
    layer = Qwen3_5DecoderLayer(text, text.layer_types.index("full_attention")).eval()
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in tensors.items() if k.startswith("layers.0.")})
    norms = {}
    for name in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        norms[name] = Qwen3_5RMSNorm(text.hidden_size, eps=text.rms_norm_eps)
        norms[name].load_state_dict({"weight": tensors[f"{name}.weight"]})
    lm = target.model.language_model
    with torch.no_grad():
        hidden = lm(input_ids=torch.tensor([prompt_ids])).last_hidden_state[0]  # h[0 .. n-1], post-norm
        tokens, rows, drafts = prompt_ids[1:] + [first], list(hidden), []
        for _ in range(k):
            n = len(tokens)
            joined = torch.cat([norms["pre_fc_norm_embedding"](lm.embed_tokens(torch.tensor(tokens))),
                                norms["pre_fc_norm_hidden"](torch.stack(rows))], dim=-1)
            x = torch.nn.functional.linear(joined, tensors["fc.weight"])[None]
            positions = torch.arange(n)[None].expand(3, 1, n)
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = norms["norm"](layer(x, lm.rotary_emb(x, positions), attention_mask=mask, position_ids=positions))[0]
            drafts.append(int(target.lm_head(out[-1]).argmax()))
            tokens, rows = tokens + [drafts[-1]], rows + [out[-1]]
    return drafts


def test_the_mtp_head_drafts_as_the_reference_computes_it(all_checkpoints, monkeypatch):
    from mmserve.runner import mtp

    model_dir = all_checkpoints["qwen3_5"]
    proposals = []
    propose = mtp.MtpProposer.propose
    monkeypatch.setattr(mtp.MtpProposer, "propose",
                        lambda self, *a: proposals.append(propose(self, *a)) or proposals[-1])
    with LLM(str(model_dir), num_kv_blocks=64, speculative_config=MTP) as llm:
        output = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    first = next(p for p in proposals if p)  # after the prompt's step: the drafts after its first token
    expected = _reference_mtp_drafts(model_dir, list(output.prompt_token_ids), output.outputs[0].token_ids[0], 3)
    assert list(next(iter(first.values()))) == expected


def test_mtp_under_preemption_leaves_nothing_behind(all_checkpoints):
    model_dir = all_checkpoints["qwen3_5"]
    prompts = [p + f" {i}" for i, p in enumerate(PROMPTS * 2)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = []
    for extra in ({}, {"speculative_config": MTP}):
        with LLM(str(model_dir), num_kv_blocks=10, block_size=16, **extra) as llm:  # too few blocks: preempts
            results.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)])
            stats = llm.get_stats()
            llm.check_integrity()
    assert results[1] == results[0]
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_drafts"] > 0
