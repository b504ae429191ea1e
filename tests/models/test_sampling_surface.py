"""The sampling surface against transformers, per family: logprobs (the raw distribution, float32) of
every generated token, the repetition penalty as transformers' generate applies it, and the OpenAI
penalties, logit bias, allowed tokens and bad words against a reference written on transformers' logits.
Each batch mixes requests with and without the options: those without answer as alone."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from mmserve import LLM, InvalidInputError, SamplingParams
from testkit.conversations import parity_workload
from testkit.families import FAMILIES
from tests.models.helpers import load_processor, reference_inputs

NUM_TOKENS = 6
TOP = 5
# a text-only chat, one image, two images
CONVERSATIONS = (0, 3, 8)


def _reference(model_dir, family, messages, **generate_kwargs):
    """transformers' generated ids and raw logits per step, for one conversation."""
    inputs = reference_inputs(model_dir, family, messages)
    model = _reference_model(model_dir, FAMILIES[family])
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, **generate_kwargs)
    ids = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return ids, [step[0].float() for step in out.logits], inputs["input_ids"].shape[1]


_MODELS: dict = {}


def _reference_model(model_dir, fixture):
    if model_dir not in _MODELS:
        _MODELS.clear()  # one family's model at a time
        _MODELS[model_dir] = fixture.reference_class().from_pretrained(model_dir).eval()
    return _MODELS[model_dir]


def test_logprobs_are_transformers_log_softmax(served_family, served_model_dir):
    """Greedy, in one batch with a request that asks for no logprobs: every sampled token's logprob and
    the top 5 equal the log-softmax of transformers' logits within 1e-4; ranks are 1 (greedy); token ids,
    logprob entries and completion tokens line up."""
    workload = parity_workload(served_family)
    chats = [workload[i] for i in CONVERSATIONS]
    llm = LLM(str(served_model_dir))
    asked = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, logprobs=TOP)
    plain = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
    outputs = llm.chat(chats + [chats[1]], [asked] * len(chats) + [plain], use_tqdm=False)
    assert outputs[-1].outputs[0].logprobs is None and outputs[-1].outputs[0].cumulative_logprob is None
    assert outputs[-1].outputs[0].token_ids == outputs[1].outputs[0].token_ids
    for messages, output in zip(chats, outputs):
        completion = output.outputs[0]
        ids, logits, _ = _reference(served_model_dir, served_family, messages)
        assert completion.token_ids == ids
        assert len(completion.logprobs) == len(completion.token_ids)
        total = 0.0
        for token, entry, step_logits in zip(ids, completion.logprobs, logits):
            ref = step_logits.log_softmax(dim=-1)
            assert entry[token].rank == 1
            assert entry[token].logprob == pytest.approx(ref[token].item(), abs=1e-4)
            total += entry[token].logprob
            top = sorted(entry.items(), key=lambda kv: kv[1].rank)[:TOP]
            assert [lp.rank for _, lp in top] == list(range(1, TOP + 1))
            torch.testing.assert_close(torch.tensor([lp.logprob for _, lp in top]), ref.topk(TOP).values,
                                       rtol=0, atol=1e-4)
            for token_id, lp in top:
                assert lp.logprob == pytest.approx(ref[token_id].item(), abs=1e-4)
                assert lp.decoded_token == llm.engine.processor.tokenizer.decode([token_id], skip_special_tokens=False)
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-9)
    llm.check_integrity()


def test_repetition_penalty_answers_as_transformers_generate(served_family, served_model_dir):
    chat = parity_workload(served_family)[3]
    ids, _, _ = _reference(served_model_dir, served_family, chat, repetition_penalty=1.8)
    llm = LLM(str(served_model_dir))
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, repetition_penalty=1.8)
    assert llm.chat([chat], params, use_tqdm=False)[0].outputs[0].token_ids == ids
    llm.check_integrity()


class _VllmOrderReference:
    """A transformers logits processor doing what mmserve documents, written the plain way: allowed
    tokens, bad words (over the generated tokens), logit bias, then OpenAI's frequency and presence
    penalties over the generated tokens."""

    def __init__(self, prompt_len, vocab, *, allowed=None, bad_words=(), bias=None, frequency=0.0, presence=0.0):
        self.prompt_len, self.vocab, self.allowed, self.bad_words = prompt_len, vocab, allowed, bad_words
        self.bias, self.frequency, self.presence = bias or {}, frequency, presence

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        generated = input_ids[0, self.prompt_len:].tolist()
        if self.allowed is not None:
            keep = torch.full_like(scores, float("-inf"))
            keep[:, list(self.allowed)] = 0
            scores = scores + keep
        for word in self.bad_words:
            if len(word) == 1 or generated[-(len(word) - 1):] == list(word[:-1]):
                scores[0, word[-1]] = float("-inf")
        for token_id, value in self.bias.items():
            scores[0, token_id] += value
        for token_id in set(generated):
            scores[0, token_id] -= self.frequency * generated.count(token_id) + self.presence
        return scores


def test_penalties_bias_allowed_and_bad_words_against_a_reference(served_family, served_model_dir):
    """Each option (and all at once) changes the answer as the reference on transformers' logits does;
    a request without options in the same batch answers as alone."""
    from transformers import LogitsProcessorList

    chat = parity_workload(served_family)[3]
    llm = LLM(str(served_model_dir))
    greedy = dict(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)  # as _reference generates
    alone = llm.chat([chat], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].token_ids
    first = alone[0]
    tokenizer = llm.engine.processor.tokenizer
    vocab = llm.engine.spec.vocab_size
    # a word the request would say (the tiny vocabularies hold tokens that decode to whitespace only)
    bad_word = next((w for w in (tokenizer.decode([t]) for t in alone) if w.strip()), "a")
    bad_ids = tokenizer.bad_words_token_ids((bad_word,))
    allowed = sorted({first, alone[-1], 1, 2, 3, vocab - 1})
    cases = {
        "frequency": ({"frequency_penalty": 2.0}, {"frequency": 2.0}),
        "presence": ({"presence_penalty": -1.5}, {"presence": -1.5}),
        "bias": ({"logit_bias": {first: -100.0, vocab - 1: 7.5}}, {"bias": {first: -100.0, vocab - 1: 7.5}}),
        "allowed": ({"allowed_token_ids": allowed}, {"allowed": allowed}),
        "bad_words": ({"bad_words": [bad_word]}, {"bad_words": bad_ids}),
        "all": ({"frequency_penalty": 1.0, "presence_penalty": 0.5, "logit_bias": {vocab - 1: 2.0},
                 "allowed_token_ids": allowed, "bad_words": [bad_word]},
                {"frequency": 1.0, "presence": 0.5, "bias": {vocab - 1: 2.0}, "allowed": allowed,
                 "bad_words": bad_ids}),
    }
    params = [SamplingParams(**greedy, **ours) for ours, _ in cases.values()] + [SamplingParams(**greedy)]
    outputs = llm.chat([chat] * len(params), params, use_tqdm=False)
    assert outputs[-1].outputs[0].token_ids == alone
    for (name, (_, ref_kwargs)), output in zip(cases.items(), outputs):
        processor = load_processor(served_model_dir)
        rendered = processor.render_chat(chat)
        prompt_len = processor.process(rendered.prompt, images=rendered.images).num_tokens
        reference = _VllmOrderReference(prompt_len, vocab, **ref_kwargs)
        ids, _, _ = _reference(served_model_dir, served_family, chat,
                               logits_processor=LogitsProcessorList([reference]))
        assert output.outputs[0].token_ids == ids, name
    assert outputs[list(cases).index("bias")].outputs[0].token_ids[0] != first  # the options act
    llm.check_integrity()


def test_token_ids_outside_the_vocabulary_are_refused(all_checkpoints):
    llm = LLM(str(all_checkpoints["qwen2_vl"]))
    vocab = llm.engine.spec.vocab_size
    for field, value, named in (("logit_bias", {vocab: 1.0, 3: 1.0, vocab + 7: 2.0}, f"ids {vocab}, {vocab + 7} are"),
                                ("allowed_token_ids", [0, vocab + 3], f"id {vocab + 3} is")):
        with pytest.raises(InvalidInputError, match=f"{field}: token {named} out of vocabulary \\(size {vocab}\\)"
                           ) as raised:
            llm.generate(["Hello"], SamplingParams(**{field: value}), use_tqdm=False)
        assert raised.value.param == field
    assert llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    llm.check_integrity()


def test_logprobs_survive_preemption_and_chunked_prefill(all_checkpoints):
    """A KV cache too small for the batch preempts and recomputes; prompts are prefilled in chunks: the
    logprobs (and penalties' counts) are those of an unhurried run."""
    model_dir = all_checkpoints["qwen2_vl"]
    chats = parity_workload("qwen2_vl")
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24, logprobs=2, frequency_penalty=0.4)
    calm = LLM(str(model_dir)).chat(chats, params, use_tqdm=False)
    tight = LLM(str(model_dir), num_kv_blocks=24, max_num_batched_tokens=64)
    hurried = tight.chat(chats, params, use_tqdm=False)
    assert tight.get_stats()["num_preemptions"] > 0
    for a, b in zip(calm, hurried):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            for token_id in x:
                assert x[token_id].logprob == pytest.approx(y[token_id].logprob, abs=1e-4)
    tight.check_integrity()


# ---- n choices ------------------------------------------------------------------------------------------
def _image_chat(family="qwen2_vl"):
    return parity_workload(family)[4]  # one 224x224 image


def test_n_choices_share_one_prefill_and_one_encode(all_checkpoints):
    """n=8 on an image request: the image is encoded once, the prompt's full blocks are computed once
    (each further choice computes only the tokens after them), and choice i is the request with seed+i."""
    llm = LLM(str(all_checkpoints["qwen2_vl"]))
    block = llm.engine.config.cache.block_size
    params = SamplingParams(n=8, temperature=0.9, seed=11, max_tokens=10)
    out = llm.chat([_image_chat()], params, use_tqdm=False)[0]
    stats = llm.get_stats()
    prompt_len = len(out.prompt_token_ids)
    tail = prompt_len - block * ((prompt_len - 1) // block)
    assert [o.index for o in out.outputs] == list(range(8))
    assert stats["encoder_items_encoded"] == 1
    assert stats["prompt_tokens_computed"] == prompt_len + 7 * tail
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # the choices are sampled independently
    llm.check_integrity()
    for i in (0, 5):  # each choice is reproducible on its own
        alone = LLM(str(all_checkpoints["qwen2_vl"])).chat(
            [_image_chat()], SamplingParams(temperature=0.9, seed=11 + i, max_tokens=10), use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[i].token_ids
    again = llm.chat([_image_chat()], params, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    llm.check_integrity()


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_5"])  # qwen3_5: each choice forks the prompt's state
def test_greedy_n_returns_n_copies_with_logprobs(all_checkpoints, family):
    llm = LLM(str(all_checkpoints[family]))
    chat = _image_chat()
    single = llm.chat([chat], SamplingParams(temperature=0, max_tokens=6, logprobs=2), use_tqdm=False)[0].outputs[0]
    many = llm.chat([chat], SamplingParams(n=3, temperature=0, max_tokens=6, logprobs=2), use_tqdm=False)[0]
    assert [o.token_ids for o in many.outputs] == [single.token_ids] * 3
    for o in many.outputs:
        assert len(o.logprobs) == len(o.token_ids)
        assert o.cumulative_logprob == pytest.approx(single.cumulative_logprob, abs=1e-4)
    llm.check_integrity()


def test_n_choices_under_preemption_and_chunking_and_abort(all_checkpoints):
    """Seeded choices answer the same when a tight KV cache preempts them and prompts are chunked; an
    abort mid-generation ends every choice and frees everything."""
    model_dir = str(all_checkpoints["qwen2_vl"])
    chats = parity_workload("qwen2_vl")[3:9]
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=16, min_tokens=16)
    calm = LLM(model_dir).chat(chats, params, use_tqdm=False)
    tight = LLM(model_dir, num_kv_blocks=24, max_num_batched_tokens=64)
    hurried = tight.chat(chats, params, use_tqdm=False)
    assert tight.get_stats()["num_preemptions"] > 0
    assert [[o.token_ids for o in r.outputs] for r in calm] == [[o.token_ids for o in r.outputs] for r in hurried]
    tight.check_integrity()
    engine = tight.engine
    engine.add_request("many", engine.process_chat(chats[0]), SamplingParams(n=4, max_tokens=50, min_tokens=50))
    seen = []
    while len(seen) < 6:
        seen += engine.step()
    assert not any(o.finished for o in seen) and {o.request_id for o in seen} == {"many"}
    aborted = engine.abort_request(["many"])
    assert aborted[-1].finished and [o.finish_reason for o in aborted[-1].outputs] == ["abort"] * 4
    engine.step()
    tight.check_integrity()
    assert not engine.has_unfinished_requests()


# ---- prompt logprobs ---------------------------------------------------------------------------------------
def test_prompt_logprobs_are_transformers_log_softmax(served_family, served_model_dir):
    """Every prompt token after the first (image placeholder rows included) gets the log-softmax of
    transformers' logits at the position before it, within 1e-4, with its rank and the top 3; the same
    when the prompt is prefilled in chunks, and when an identical prompt is already in the prefix cache."""
    chat = parity_workload(served_family)[4]
    processor = load_processor(served_model_dir)
    rendered = processor.render_chat(chat)
    prompt = processor.process(rendered.prompt, images=rendered.images, videos=rendered.videos)
    fixture = FAMILIES[served_family]
    inputs = fixture.reference_kwargs(served_model_dir, chat, prompt)
    with torch.no_grad():
        ref = _reference_model(served_model_dir, fixture)(**inputs).logits[0].float().log_softmax(dim=-1)
    ids = prompt.prompt_token_ids
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    for llm in (LLM(str(served_model_dir)), LLM(str(served_model_dir), max_num_batched_tokens=48)):
        for _ in range(2):  # the second time, the prompt's blocks are in the prefix cache
            out = llm.chat([chat], params, use_tqdm=False)[0]
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
            for position in range(1, len(ids)):
                entry, token = out.prompt_logprobs[position], ids[position]
                expected = ref[position - 1]
                if token >= expected.shape[0]:  # a placeholder the head cannot produce (mllama's <|image|>)
                    assert entry[token].logprob == float("-inf") and entry[token].rank == expected.shape[0] + 1
                    continue
                assert entry[token].logprob == pytest.approx(expected[token].item(), abs=1e-4)
                near_ties = int(((expected - expected[token]).abs() < 1e-4).sum()) - 1
                assert abs(entry[token].rank - 1 - int((expected > expected[token]).sum())) <= near_ties
                top = sorted((lp for lp in entry.values() if lp.rank <= 3), key=lambda lp: lp.rank)
                torch.testing.assert_close(torch.tensor([lp.logprob for lp in top]), expected.topk(3).values,
                                           rtol=0, atol=1e-4)
        llm.check_integrity()


def test_cache_salt_separates_prefix_cache_users(all_checkpoints):
    """Only requests with the same cache_salt share prefix-cache blocks (the answers are the same)."""
    llm = LLM(str(all_checkpoints["qwen2_vl"]))
    text = "A long shared instruction that fills several KV blocks. " * 6
    params = SamplingParams(temperature=0, max_tokens=3)

    def hit(prompt):
        return llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens

    assert hit({"prompt": text, "cache_salt": "alice"}) == 0
    assert hit({"prompt": text, "cache_salt": "alice"}) > 0
    assert hit({"prompt": text, "cache_salt": "bob"}) == 0
    assert hit({"prompt": text}) == 0 and hit({"prompt": text}) > 0
    with pytest.raises(InvalidInputError) as raised:
        llm.generate([{"prompt": text, "cache_salt": 5}], params, use_tqdm=False)
    assert raised.value.param == "cache_salt"
    llm.check_integrity()


def test_logprobs_mode_reports_logits_or_the_processed_distribution(all_checkpoints):
    """vLLM's logprobs_mode: raw_logits entries are the logits (raw logprobs plus one constant per
    position); processed_logprobs are the distribution each token was drawn from: a seeded request at
    temperature 0.7 with top_k=3 gets the log-softmax of its three best logits / 0.7 and -inf beyond
    them, the same tokens as under the default mode."""
    model = str(all_checkpoints["qwen2_vl"])
    prompt = "Tell me about the colour of the sky."
    greedy = SamplingParams(temperature=0, max_tokens=4, logprobs=5)
    sampled = SamplingParams(temperature=0.7, top_k=3, seed=11, max_tokens=4, logprobs=5)
    answers = {}
    for mode in ("raw_logprobs", "raw_logits", "processed_logprobs"):
        llm = LLM(model, logprobs_mode=mode)
        answers[mode] = [o.outputs[0] for o in llm.generate([prompt, prompt], [greedy, sampled], use_tqdm=False)]
        llm.check_integrity()
    raw, logits, processed = answers["raw_logprobs"], answers["raw_logits"], answers["processed_logprobs"]
    for i in range(2):
        assert raw[i].token_ids == logits[i].token_ids == processed[i].token_ids
    for raw_entry, logit_entry in zip(raw[0].logprobs, logits[0].logprobs):
        assert raw_entry.keys() == logit_entry.keys()
        shifts = [logit_entry[t].logprob - raw_entry[t].logprob for t in raw_entry]
        assert max(shifts) - min(shifts) < 1e-4 and [e.rank for e in raw_entry.values()] == \
            [e.rank for e in logit_entry.values()]
    for token, raw_entry, entry in zip(processed[1].token_ids, raw[1].logprobs, processed[1].logprobs):
        best = sorted(raw_entry.values(), key=lambda lp: lp.rank)[:3]
        expected = torch.tensor([lp.logprob for lp in best]).div(0.7).log_softmax(dim=-1)
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in ranked[:3]]), expected, rtol=0, atol=1e-4)
        assert all(lp.logprob == -float("inf") for lp in ranked[3:]) and entry[token].rank <= 3
    with pytest.raises(ValueError, match="logprobs_mode"):
        LLM(model, logprobs_mode="softmax")


def test_truncate_prompt_tokens_keeps_the_last_tokens(all_checkpoints):
    """Offline truncate_prompt_tokens: a text prompt keeps its last k tokens and answers as that prompt
    given whole; -1 keeps what the context holds; a prompt with an image is refused, not cut, naming the
    field; a prompt no longer than k is untouched."""
    llm = LLM(str(all_checkpoints["qwen2_vl"]), max_model_len=64)
    ids = llm.engine.process("one two three four five six seven eight nine ten").prompt_token_ids
    greedy = SamplingParams(temperature=0, max_tokens=3)
    cut, whole_tail, short, longest = llm.generate(
        [{"prompt_token_ids": list(ids)}, {"prompt_token_ids": list(ids[-4:])}, {"prompt_token_ids": list(ids)},
         {"prompt_token_ids": list(range(5, 100))}],
        [SamplingParams(temperature=0, max_tokens=3, truncate_prompt_tokens=4), greedy,
         SamplingParams(temperature=0, max_tokens=3, truncate_prompt_tokens=len(ids)),
         SamplingParams(temperature=0, max_tokens=1, truncate_prompt_tokens=-1)], use_tqdm=False)
    assert cut.prompt_token_ids == list(ids[-4:]) and cut.outputs[0].token_ids == whole_tail.outputs[0].token_ids
    assert short.prompt_token_ids == list(ids)
    assert longest.prompt_token_ids == list(range(5, 100))[-63:]
    picture = {"prompt": "<|vision_start|><|image_pad|><|vision_end|>What is it?",
               "multi_modal_data": {"image": Image.new("RGB", (56, 56), (200, 10, 10))}}
    with pytest.raises(InvalidInputError) as raised:
        llm.generate([picture], SamplingParams(max_tokens=2, truncate_prompt_tokens=2), use_tqdm=False)
    assert raised.value.param == "truncate_prompt_tokens"
    llm.check_integrity()


def test_a_refused_request_leaves_nothing_behind(all_checkpoints):
    """A request refused while it is added (n choices with a bad word that is not Unicode; the second of a
    batch naming a token outside the vocabulary) leaves no choice, group or earlier request running;
    seeds near the top of the range still give every choice its own."""
    llm = LLM(str(all_checkpoints["qwen2_vl"]))
    with pytest.raises(InvalidInputError) as raised:
        llm.generate(["hello"], SamplingParams(n=3, bad_words=["\ud800"]), use_tqdm=False)
    assert raised.value.param == "bad_words"
    llm.check_integrity()
    vocab = llm.engine.spec.vocab_size
    with pytest.raises(InvalidInputError):
        llm.generate(["one", "two"], [SamplingParams(max_tokens=3), SamplingParams(logit_bias={vocab: 1.0})],
                     use_tqdm=False)
    llm.check_integrity()
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(["hi"], SamplingParams(n=2, seed=2**64 - 1, max_tokens=3), use_tqdm=False)[0]
    assert len(out.outputs) == 2
    assert hash(SamplingParams(logit_bias={1: 2.0})) == hash(SamplingParams(logit_bias={3: 4.0}))
    llm.check_integrity()
