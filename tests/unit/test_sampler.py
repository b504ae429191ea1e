import dataclasses

import pytest
import torch

from mmserve.runner.sampler import (
    PenaltyBatch,
    Sampler,
    SamplingMetadata,
    _apply_penalties,
    _inverse_cdf_draw,
    greedy_argmax,
    make_generator,
    sampled_logprobs,
)
from mmserve.runner.sampling_state import bad_word_bans

VOCAB = 50


def meta_for(num_rows, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, banned=None):
    seeds = seeds if seeds is not None else [None] * num_rows
    return SamplingMetadata(
        temperatures=[temperature] * num_rows, top_ks=[top_k] * num_rows, top_ps=[top_p] * num_rows,
        min_ps=[min_p] * num_rows, generators=[make_generator(s, "cpu") for s in seeds],
        banned_token_ids=banned if banned is not None else [()] * num_rows)


def random_logits(num_rows, vocab=VOCAB, seed=0, dtype=torch.float32):
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)).mul_(3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_equals_argmax(dtype):
    logits = random_logits(16, dtype=dtype)
    out = Sampler()(logits, meta_for(16, temperature=0.0))
    assert out.dtype == torch.int64 and out.shape == (16,)
    assert torch.equal(out, torch.argmax(logits, dim=-1))


def test_top_k_one_is_greedy_even_with_temperature():
    logits = random_logits(16, seed=1)
    out = Sampler()(logits, meta_for(16, temperature=1.5, top_k=1))
    assert torch.equal(out, logits.argmax(dim=-1))


def test_caller_logits_are_not_modified():
    logits = random_logits(4)
    before = logits.clone()
    Sampler()(logits, meta_for(4, top_k=5, top_p=0.5, min_p=0.1, banned=[(1, 2)] * 4))
    assert torch.equal(logits, before)


def test_banned_tokens_never_sampled_or_chosen_greedily():
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 10.0  # the favourite, banned below
    banned = [(7, 8, 9), (7,)]
    torch.manual_seed(0)
    for temperature in (0.0, 1.0, 5.0):
        for _ in range(50):
            out = Sampler()(logits, meta_for(2, temperature=temperature, banned=banned)).tolist()
            assert out[0] not in banned[0] and out[1] not in banned[1]


def test_out_of_vocab_banned_ids_are_ignored():
    logits = random_logits(1)
    out = Sampler()(logits, meta_for(1, temperature=0.0, banned=[(VOCAB + 5,)]))
    assert out.item() == logits.argmax().item()


@pytest.mark.parametrize("top_p", [1e-6, 1e-300])  # 1e-300 is 0 in float32: still the top token, no failure
def test_tiny_top_p_keeps_only_the_top_token(top_p):
    logits = random_logits(8, seed=2)
    torch.manual_seed(0)
    for _ in range(20):
        out = Sampler()(logits, meta_for(8, temperature=2.0, top_p=top_p))
        assert torch.equal(out, logits.argmax(dim=-1))


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probs 0.5, 0.3, 0.2: top_p=0.7 needs the top two; the third must never appear.
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    meta = meta_for(1, top_p=0.7, seeds=[3])
    seen = {Sampler()(logits, meta).item() for _ in range(300)}
    assert seen == {0, 1}


def test_top_k_restricts_to_the_k_best():
    logits = random_logits(1, seed=4)
    best3 = set(logits[0].topk(3).indices.tolist())
    meta = meta_for(1, temperature=10.0, top_k=3, seeds=[5])
    seen = {Sampler()(logits, meta).item() for _ in range(300)}
    assert seen == best3


def test_min_p_filters_unlikely_tokens():
    # probs 0.4, 0.3, 0.2, 0.1: min_p=0.6 keeps tokens with prob >= 0.24.
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    meta = meta_for(1, min_p=0.6, seeds=[6])
    seen = {Sampler()(logits, meta).item() for _ in range(300)}
    assert seen == {0, 1}


def test_mixed_batch_applies_each_rows_options():
    logits = random_logits(4, seed=7)
    meta = SamplingMetadata(temperatures=[0.0, 1.0, 1.0, 1.0], top_ks=[0, 1, 0, 0], top_ps=[1.0, 1.0, 1e-6, 1.0],
                            min_ps=[0.0, 0.0, 0.0, 1.0], generators=[None] * 4, banned_token_ids=[()] * 4)
    torch.manual_seed(0)
    for _ in range(20):
        # every row's options force its argmax: greedy, top_k=1, tiny top_p, min_p=1
        assert torch.equal(Sampler()(logits, meta), logits.argmax(dim=-1))


def _run_seeded(rows, steps, base_logits):
    """rows: list of (seed, logits_row_index). Returns per-row token lists over `steps` steps."""
    generators = [make_generator(seed, "cpu") for seed, _ in rows]
    meta = SamplingMetadata(temperatures=[1.0] * len(rows), top_ks=[20] * len(rows), top_ps=[0.9] * len(rows),
                            min_ps=[0.01] * len(rows), generators=generators, banned_token_ids=[()] * len(rows))
    tokens = [[] for _ in rows]
    for step in range(steps):
        logits = torch.stack([base_logits[(i + step) % len(base_logits)] for _, i in rows])
        for row, token in enumerate(Sampler()(logits, meta).tolist()):
            tokens[row].append(token)
    return tokens


def test_seeded_rows_reproduce_across_batch_composition_and_order():
    base = random_logits(6, seed=8).div_(3)  # flatter, so many tokens are possible
    alone = _run_seeded([(42, 0)], 40, base)[0]
    torch.manual_seed(1)
    batch_a = _run_seeded([(None, 1), (42, 0), (7, 2), (None, 3)], 40, base)
    torch.manual_seed(2)
    batch_b = _run_seeded([(7, 2), (None, 5), (None, 4), (None, 3), (42, 0)], 40, base)
    assert batch_a[1] == alone and batch_b[4] == alone
    assert batch_a[2] == batch_b[0]
    assert len(set(alone)) > 5  # it really sampled


def test_different_seeds_give_different_sequences():
    flat = torch.zeros(1, VOCAB)
    a = _run_seeded([(1, 0)], 30, flat)[0]
    b = _run_seeded([(2, 0)], 30, flat)[0]
    assert a != b


def test_frequencies_follow_softmax():
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0, 1.5])
    temperature = 0.8
    num_rows = 4000
    meta = meta_for(num_rows, temperature=temperature)
    torch.manual_seed(1234)
    out = Sampler()(logits.expand(num_rows, -1), meta)
    freq = torch.bincount(out, minlength=5).float() / num_rows
    expected = (logits / temperature).softmax(dim=-1)
    assert torch.allclose(freq, expected, atol=0.03), (freq, expected)


@pytest.mark.parametrize("vocab", [5, 256, 700, 1037])
def test_draw_follows_probabilities_across_blocks_and_never_picks_zero_mass(vocab):
    # mass spread over several 256-token blocks, with zero-mass tokens (masked: inside blocks, whole blocks,
    # the vocabulary's tail) that no uniform may reach, including the extreme uniforms 0 and 1 - 2^-24
    probs = torch.rand(vocab, generator=torch.Generator().manual_seed(vocab))
    probs[::3] = 0.0
    probs[-min(vocab // 2, 300):] = 0.0
    probs *= 7.0  # unnormalised: the draw scales by the row's mass
    uniforms = torch.cat([torch.rand(20000, generator=torch.Generator().manual_seed(1)),
                          torch.tensor([0.0, 1.0 - 2.0**-24, 0.5])])
    drawn = _inverse_cdf_draw(probs.expand(len(uniforms), -1), uniforms)
    assert drawn.min() >= 0 and drawn.max() < vocab
    assert (probs[drawn] > 0).all()
    freq = torch.bincount(drawn[:20000], minlength=vocab).double() / 20000
    assert torch.allclose(freq, (probs / probs.sum()).double(), atol=0.012)
    # the first positive token for uniform 0, the last positive one for the largest uniform
    positive = probs.nonzero().squeeze(1)
    assert drawn[20000] == positive[0] and drawn[20001] == positive[-1]


def test_make_generator():
    assert make_generator(None, "cpu") is None
    g = make_generator(2**70 + 5, "cpu")  # any Python int is accepted
    assert isinstance(g, torch.Generator)


def test_metadata_lengths_must_agree():
    with pytest.raises(ValueError):
        SamplingMetadata(temperatures=[1.0], top_ks=[0, 0], top_ps=[1.0], min_ps=[0.0], generators=[None],
                         banned_token_ids=[()])


@pytest.mark.parametrize("vocab", [397, 4096, 32000, 32001, 151936])
def test_greedy_argmax_is_argmax(vocab):
    """The blocked argmax returns exactly argmax's index: random rows, ties (the first wins), a NaN,
    an all -inf row, bfloat16."""
    torch.manual_seed(vocab)
    logits = torch.randn(6, vocab)
    logits[1, :] = 0.0  # all tied: index 0
    logits[2, vocab // 3] = logits[2, vocab - 1] = 100.0  # tie between two blocks: the first
    logits[3, vocab - 1] = float("nan")
    logits[4, :] = float("-inf")
    assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))
    half = logits.to(torch.bfloat16)
    assert torch.equal(greedy_argmax(half), half.argmax(dim=-1))


# ---- the processing stages and logprobs -----------------------------------------------------------
def _with(meta, **fields):
    return dataclasses.replace(meta, **fields)


def _penalties(rows, counts, seen, presence, frequency, repetition):
    def col(values):
        return torch.tensor(values, dtype=torch.float32).unsqueeze(1)
    return PenaltyBatch(torch.tensor(rows), torch.stack(counts), torch.stack(seen), col(presence), col(frequency),
                        col(repetition))


def test_penalties_follow_openai_and_transformers_definitions():
    """Repetition (transformers' RepetitionPenaltyLogitsProcessor over prompt + output), then OpenAI's
    frequency and presence penalties over the output's counts, on the penalised rows only."""
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = random_logits(3, seed=7)
    prompt, output = [1, 2, 3, 3], [4, 4, 4, 9, 1]
    counts = torch.zeros(VOCAB)
    for t in output:
        counts[t] += 1
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    seen[prompt + output] = True
    meta = _with(meta_for(3, temperature=0.0), penalties=_penalties([1], [counts], [seen], [0.5], [0.7], [1.3]))
    got = Sampler()(logits, meta)
    reference = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits[1:2].clone())[0]
    for token in set(output):
        reference[token] -= 0.7 * output.count(token) + 0.5
    assert got[1].item() == reference.argmax().item()
    assert got[0].item() == logits[0].argmax().item() and got[2].item() == logits[2].argmax().item()
    # the stage itself, value for value
    processed = logits.clone()
    _apply_penalties(processed, meta.penalties)
    torch.testing.assert_close(processed[1], reference, rtol=0, atol=1e-6)
    assert torch.equal(processed[[0, 2]], logits[[0, 2]])


def test_bias_allowed_masks_and_bans_apply_to_their_rows():
    logits = torch.zeros(3, VOCAB)
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[[7, 8]] = True
    logits[0, 8] = 1.0
    meta = _with(meta_for(3, temperature=0.0, banned=[(), (), (3,)]), allowed_masks=[(0, allowed)],
                 logit_bias=[(1, {11: 5.0, 12: 4.0}), (2, {3: 100.0, 4: 1.0})])
    assert Sampler()(logits, meta).tolist() == [8, 11, 4]  # row 2: its biased token is banned
    # sampled rows keep to their allowed tokens too
    sampled = _with(meta_for(1, temperature=1.5), allowed_masks=[(0, allowed)])
    assert {Sampler()(torch.zeros(1, VOCAB), sampled).item() for _ in range(50)} <= {7, 8}


def test_logprobs_are_the_raw_distribution_whatever_the_processing():
    """The sampled token's logprob, its rank and the top-k come from the log-softmax of the logits before
    temperature, bias or masks; rows that did not ask get none."""
    logits = random_logits(4, seed=3)
    meta = _with(meta_for(4, temperature=0.0), logit_bias=[(0, {5: 100.0})], num_logprobs=[3, None, 0, 5])
    tokens = Sampler()(logits, meta)
    assert tokens[0].item() == 5
    out = sampled_logprobs(logits, tokens, meta.num_logprobs)
    assert out.rows == [0, 2, 3]
    raw = logits.log_softmax(dim=-1)
    for i, row in enumerate(out.rows):
        token = tokens[row].item()
        assert out.logprobs[i].item() == pytest.approx(raw[row, token].item(), abs=1e-6)
        assert out.ranks()[i] == 1 + int((raw[row] > raw[row, token]).sum())
        top = raw[row].topk(5)
        assert torch.equal(out.top_ids[i], top.indices) and torch.allclose(out.top_logprobs[i], top.values)
    assert out.ranks()[0] > 1  # the bias picked a token the model did not rank first
    assert sampled_logprobs(logits, tokens, None) is None and sampled_logprobs(logits, tokens, [None] * 4) is None


def test_processed_logits_are_what_each_row_was_drawn_from():
    """`sample(keep_processed=True)` keeps vLLM's processed logits: a greedy row's after bias and bans (its
    temperature ignored), a sampled row's after temperature, top-k and min-p, -inf where a token was
    dropped; every drawn token is finite there, and the raw logits are untouched. Without processing, the
    processed logits are the raw ones."""
    logits = random_logits(3, seed=4)
    raw = logits.clone()
    meta = _with(meta_for(3, temperature=2.0, top_k=4, banned=[(1,), (), ()]),
                 temperatures=[0.0, 2.0, 0.5], min_ps=[0.0, 0.0, 0.5], logit_bias=[(0, {3: 5.0})])
    tokens, processed = Sampler().sample(logits, meta, keep_processed=True)
    assert torch.equal(logits, raw)
    greedy = raw[0].clone()
    greedy[1] = -torch.inf
    greedy[3] += 5.0
    assert torch.equal(processed[0], greedy) and tokens[0].item() == greedy.argmax().item()
    scaled = raw[1] / 2.0
    kept = scaled >= scaled.topk(4).values[-1]
    assert torch.equal(processed[1][kept], scaled[kept]) and bool((processed[1][~kept] == -torch.inf).all())
    cold = raw[2] / 0.5
    cold[cold < cold.topk(4).values[-1]] = -torch.inf
    probs = cold.softmax(dim=-1)
    assert torch.equal(processed[2] == -torch.inf, (probs < 0.5 * probs.max()))
    assert bool(processed.gather(1, tokens.unsqueeze(1)).isfinite().all())
    plain_tokens, plain = Sampler().sample(raw, meta_for(3, temperature=0.0), keep_processed=True)
    assert plain is raw and torch.equal(plain_tokens, raw.argmax(dim=-1))
    assert Sampler().sample(raw, meta, keep_processed=False)[1] is None


def test_logprobs_of_processed_logits_and_logits_themselves():
    """normalize=False reports the logits themselves (vLLM's *_logits modes), ranked the same way."""
    logits = random_logits(2, seed=6)
    tokens = logits.argmax(dim=-1)
    out = sampled_logprobs(logits, tokens, [2, 2], normalize=False)
    assert torch.equal(out.logprobs, logits.max(dim=-1).values) and out.ranks() == [1, 1]
    assert torch.equal(out.top_logprobs, logits.topk(2).values)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_ranks_inside_and_outside_the_top_k(k):
    """A rank is 1 + the tokens strictly more likely, for tokens sampled inside the top k, at its edge
    (ties with the k-th best), and from the tail (counted over the vocabulary)."""
    logits = random_logits(6, seed=9)
    logits[2, 10] = logits[2, 11] = logits[2].max() + 1.0  # a tie for the best token
    raw = logits.log_softmax(dim=-1)
    order = raw.argsort(dim=-1, descending=True)
    picks = [order[0, 0], order[1, max(k - 1, 0)], torch.tensor(11), order[3, k], order[4, -1], order[5, 20]]
    tokens = torch.stack(picks).long()
    out = sampled_logprobs(logits, tokens, [k] * 6)
    assert out.ranks() == [1 + int((raw[r] > raw[r, t]).sum()) for r, t in enumerate(tokens.tolist())]
    assert out.ranks()[2] == 1


def test_bad_word_bans_match_the_output_tail():
    words = ((5,), (1, 2, 3), (2, 9))
    assert bad_word_bans(words, []) == (5,)
    assert bad_word_bans(words, [7, 1, 2]) == (5, 3, 9)
    assert bad_word_bans(words, [1, 2, 4]) == (5,)


@pytest.mark.parametrize("rows", [[0, 1, 2], [2, 0]])
@pytest.mark.parametrize("words", [4, 3])  # 4 words cover the 100 tokens (numpy's unpacking); 3 do not
def test_token_bitmask_bans_exactly_the_tokens_without_a_bit(rows, words):
    """Bit j of word j // 32 set = token j allowed; tokens past the words are banned; other rows untouched."""
    from mmserve.runner.sampler import apply_token_bitmask

    vocab = 100
    gen = torch.Generator().manual_seed(0)
    bits = torch.rand(len(rows), words * 32, generator=gen) < 0.3
    weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
    bitmask = (bits.view(len(rows), words, 32).long() * weights).sum(-1)
    bitmask = torch.where(bitmask >= 1 << 31, bitmask - (1 << 32), bitmask).to(torch.int32)
    logits = torch.randn(3, vocab, generator=gen)
    expected = logits.clone()
    for i, row in enumerate(rows):
        for token in range(vocab):
            if token >= words * 32 or not bits[i, token]:
                expected[row, token] = -torch.inf
    apply_token_bitmask(logits, rows, bitmask)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("rows,vocab,k", [(3, 5000, 5), (2, 151936, 1), (4, 8192, 20), (1, 300, 3), (2, 4100, 300)])
def test_blocked_topk_is_topk(rows, vocab, k):
    """The same values and indices as torch.topk, also with banned (-inf) tokens, a partial last block,
    the best tokens crowded into one block, and shapes that fall back."""
    from mmserve.runner.sampler import blocked_topk

    gen = torch.Generator().manual_seed(vocab + k)
    values = torch.randn(rows, vocab, generator=gen).log_softmax(-1)
    values[:, ::3] = -torch.inf
    values[0, 10:10 + k] = 5.0 + torch.arange(k, dtype=torch.float32)  # all k in the first block
    values[-1, vocab - 2] = 9.0  # the best in the partial last block
    want = values.topk(k, dim=-1)
    got_values, got_ids = blocked_topk(values, k)
    assert torch.equal(got_values, want.values) and torch.equal(got_ids, want.indices)
