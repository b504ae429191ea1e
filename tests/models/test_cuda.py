"""CUDA-only checks (skipped, with the reason in the summary, where no CUDA device exists; run by
scripts/gpu_check.sh on a GPU machine):
- steady-state steps make no host sync besides the one read of the sampled tokens
  (`torch.cuda.set_sync_debug_mode("error")`), with graphs on and off;
- encoder graphs on CUDA equal the eager tower in float32 and bfloat16, keep their static buffers in
  place, hand out outputs that survive the next replay, and respect the memory budget;
- the engine in bfloat16 equals transformers in bfloat16 on the same device (float32 is covered by the
  device-parametrised parity suites).
"""

import numpy as np
import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.models.qwen2_vl.vision_graph import Qwen2VisionGraphAdapter
from mmserve.runner.graphs.buckets import EncoderBucket, default_encoder_buckets
from mmserve.runner.graphs.encoder_graphs import EncoderGraphRunner
from mmserve.runner.sampler import Sampler
from testkit.families import FAMILIES as SERVED_FAMILIES
from tests.models.helpers import (
    NO_CUDA_REASON,
    image_part,
    load_processor,
    random_image,
    text_part,
    to_device,
)
from tests.unit.test_encoder_graphs import _eager, _items, _tower

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA_REASON)
CUDA = torch.device("cuda")
GREEDY = SamplingParams(temperature=0, max_tokens=10, min_tokens=10)


def _chats(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    sizes = [(90, 60), (224, 224), (57, 311), (64, 64), (150, 120)]
    return [[{"role": "user", "content": [image_part(random_image(rng, *sizes[i % len(sizes)])),
                                          text_part(f"Describe picture {i}.")]}] for i in range(n)]


class _TokenRead:
    """The sampled tokens, read with sync checking paused: the step's one allowed host sync."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def tolist(self) -> list[int]:
        torch.cuda.set_sync_debug_mode("default")
        try:
            return self.tokens.tolist()
        finally:
            torch.cuda.set_sync_debug_mode("error")


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_steady_state_steps_make_no_host_sync(model_dir, graphs, temperature):
    llm = LLM(str(model_dir), device="cuda", max_num_seqs=8, enable_encoder_cuda_graphs=graphs,
              enable_decode_cuda_graphs=graphs)
    engine = llm.engine
    sampler = Sampler()
    engine.runner.sampler = lambda logits, meta: _TokenRead(sampler(logits, meta))
    params = SamplingParams(temperature=temperature, top_p=0.9, top_k=20, max_tokens=40, min_tokens=40, seed=3)
    for i, chat in enumerate(_chats(6)):
        rendered = engine.processor.render_chat(chat)
        engine.add_request(str(i), engine.processor.process(rendered.prompt, images=rendered.images), params)
    while len(requests := engine.inspect().runner_requests) < 6 or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in requests.values()):
        engine.step()  # prefills, unchecked
    replays = 0 if not graphs else engine.inspect().graphs.decode.num_replays
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):  # steady state: every request decoding
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if graphs:
        assert engine.inspect().graphs.decode.num_replays == replays + 10


@pytest.mark.parametrize("windowed", [False, True], ids=["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_encoder_graphs_equal_the_eager_tower_on_cuda(windowed, dtype):
    tower = _tower(windowed).to(CUDA, dtype)
    adapter = Qwen2VisionGraphAdapter(tower)
    runner = EncoderGraphRunner(adapter, default_encoder_buckets(512, 4, len(adapter.attention_kinds), 4,
                                                                 min_tokens=64), CUDA)
    runner.capture_all()
    rng = np.random.default_rng(0)
    first, second = _items(rng, [(1, 10, 14), (1, 6, 4)]), _items(rng, [(2, 6, 8), (1, 8, 8)])
    out_first = runner.run(first)
    kept = [o.clone() for o in out_first]
    out_second = runner.run(second)
    assert runner.stats.num_replays == 2
    tolerance = {} if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for outs, payloads in ((out_first, first), (out_second, second)):
        for g, e in zip(outs, _eager(tower, payloads)):
            torch.testing.assert_close(g, e, **tolerance)
    assert all(torch.equal(o, k) for o, k in zip(out_first, kept))  # survived the second replay


def test_encoder_graph_memory_budget_on_cuda():
    tower = _tower(False).to(CUDA)
    buckets = [EncoderBucket(t, (2,)) for t in (64, 256, 1024, 4096)]
    runner = EncoderGraphRunner(Qwen2VisionGraphAdapter(tower), buckets, CUDA, memory_budget_bytes=1)
    stats = runner.capture_all()
    assert stats.captured == [] and stats.skipped_over_budget == buckets
    assert runner.run(_items(np.random.default_rng(0), [(1, 8, 8)])) is None


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_bfloat16_engine_equals_transformers_on_cuda(model_dir, family, graphs):
    fixture = SERVED_FAMILIES[family]
    processor = load_processor(model_dir)
    reference = fixture.reference_class().from_pretrained(model_dir, dtype=torch.bfloat16).eval().to(CUDA)
    chats = _chats(5, seed=1)
    expected = []
    for chat in chats:
        rendered = processor.render_chat(chat)
        prompt = processor.process(rendered.prompt, images=rendered.images, videos=rendered.videos)
        inputs = to_device(fixture.reference_kwargs(model_dir, chat, prompt), CUDA)
        with torch.no_grad():
            out = reference.generate(**inputs, max_new_tokens=10, min_new_tokens=10, do_sample=False)
        expected.append(out[0, inputs["input_ids"].shape[1]:].tolist())
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", enable_encoder_cuda_graphs=graphs,
              enable_decode_cuda_graphs=graphs)
    got = [o.outputs[0].token_ids for o in llm.chat(chats, GREEDY, use_tqdm=False)]
    assert got == expected
