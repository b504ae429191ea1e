"""Encoder graphs, their CPU-side checks (runner/graphs/encoder_graphs.py, runner/graphs/capture.py): on the CPU a
captured graph is a replay-equivalent that reruns the forward on the same static buffers and overwrites
the same output, so bucket padding, dummy contexts, window order, static-buffer bookkeeping and copy-out
are compared here with the eager Qwen2-VL / Qwen2.5-VL vision towers."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mmserve.models.layers.context_attention import context_attention
from mmserve.models.qwen2_vl.config import VisionConfig
from mmserve.models.qwen2_vl.processor import VisionInput
from mmserve.models.qwen2_vl.vision import VisionTransformer
from mmserve.models.qwen2_vl.vision_graph import Qwen2VisionGraphAdapter
from mmserve.runner.graphs import encoder_graphs
from mmserve.runner.graphs.buckets import EncoderBucket, default_encoder_buckets
from mmserve.runner.graphs.capture import ReplayEquivalent, StaticBuffers
from mmserve.runner.graphs.encoder_graphs import EncoderGraphRunner, capture_plan, graphed_encode_fn

CPU = torch.device("cpu")


def _tower(windowed: bool) -> VisionTransformer:
    torch.manual_seed(0)
    cfg = VisionConfig(depth=3, embed_dim=32, out_hidden_size=24, num_heads=4, mlp_hidden_size=64,
                       hidden_act="silu" if windowed else "quick_gelu", patch_size=14, temporal_patch_size=2,
                       spatial_merge_size=2, in_channels=3, rope_theta=10000.0,
                       window_size=112 if windowed else 0, fullatt_block_indexes=(1,) if windowed else (),
                       is_qwen2_5=windowed)
    tower = VisionTransformer(cfg).eval()
    with torch.no_grad():  # RMSNorm/LayerNorm weights start at 1: perturb so every parameter matters
        for p in tower.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return tower


@pytest.fixture(scope="module")
def towers():
    """windowed -> (tower, its runner with the default test buckets), built once: captures are the slow part."""
    cache = {}

    def get(windowed):
        if windowed not in cache:
            tower = _tower(windowed)
            cache[windowed] = tower, _runner(tower)
        return cache[windowed]
    return get


@pytest.fixture(params=[False, True], ids=["qwen2_vl", "qwen2_5_vl"])
def tower(request, towers):
    return towers(request.param)[0]


@pytest.fixture
def captured(towers, tower):
    """The tower's shared runner (read-only use: tests compare its counters before and after)."""
    return towers(tower.cfg.is_qwen2_5)[1]


def _items(rng, grids):
    return [VisionInput(rng.standard_normal((t * h * w, 3 * 2 * 14 * 14)).astype(np.float32), (t, h, w))
            for t, h, w in grids]


@torch.inference_mode()
def _eager(tower, payloads):
    pixels = torch.from_numpy(np.concatenate([p.pixel_values for p in payloads]))
    rows = tower(pixels, [p.grid_thw for p in payloads])
    return [r[None] for r in rows.split([t * h * w // 4 for t, h, w in (p.grid_thw for p in payloads)])]


def _runner(tower, buckets=None):
    adapter = Qwen2VisionGraphAdapter(tower)
    if buckets is None:
        buckets = default_encoder_buckets(256, 4, len(adapter.attention_kinds), adapter.token_multiple,
                                          min_tokens=64)
    runner = EncoderGraphRunner(adapter, buckets, CPU)
    runner.capture_all()
    return runner


BATCHES = [
    [(1, 8, 8)],  # one image: one frame context, four windows
    [(1, 10, 14), (1, 6, 4)],  # two images of other shapes: windows cut at the edges
    [(2, 6, 8), (1, 4, 4), (1, 12, 2)],  # a two-frame video (two full contexts) and two images
]


@pytest.mark.parametrize("segments", [[16], [5, 6, 5], [1, 30, 2, 1]])
def test_context_attention_masked_path_is_per_context_attention(segments):
    torch.manual_seed(0)
    q, k, v = (torch.randn(sum(segments), 2, 8) for _ in range(3))
    cu = torch.tensor(np.concatenate(([0], np.cumsum(segments))), dtype=torch.int32)
    got = context_attention(q, k, v, cu, max(segments))
    expected, start = [], 0
    for length in segments:
        qs, ks, vs = (x[start:start + length].transpose(0, 1) for x in (q, k, v))
        expected.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1).reshape(length, -1))
        start += length
    torch.testing.assert_close(got, torch.cat(expected))


@pytest.mark.parametrize("grids", BATCHES, ids=["one", "two", "video"])
def test_graph_outputs_equal_the_eager_tower(tower, captured, grids):
    runner, replays = captured, captured.stats.num_replays
    payloads = _items(np.random.default_rng(1), grids)
    got = runner.run(payloads)
    assert runner.stats.num_replays == replays + 1
    expected = _eager(tower, payloads)
    assert [g.shape for g in got] == [e.shape for e in expected]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_padding_is_a_dummy_context_even_when_tokens_fill_a_bucket(tower):
    """64 real tokens in a (64, ...) bucket leave no room for the dummy context: the batch takes the next
    bucket, and its output is still the eager one."""
    adapter = Qwen2VisionGraphAdapter(tower)
    kinds = len(adapter.attention_kinds)
    small, large = EncoderBucket(64, (2,) * kinds), EncoderBucket(128, (2, 8)[:kinds])
    runner = _runner(tower, [small, large])
    payloads = _items(np.random.default_rng(2), [(1, 8, 8)])  # exactly 64 tokens
    plan = runner.plan(adapter.layout(payloads))
    assert plan.bucket == large and plan.pad_tokens == 64
    assert all(min(c) >= 1 for c in plan.context_tokens)
    for g, e in zip(runner.run(payloads), _eager(tower, payloads)):
        torch.testing.assert_close(g, e)


def test_outputs_stay_valid_after_the_next_replay(tower, captured):
    runner, replays = captured, captured.stats.num_replays
    rng = np.random.default_rng(3)
    first, second = _items(rng, [(1, 8, 8)]), _items(rng, [(1, 8, 6)])
    out_first = runner.run(first)
    kept = [o.clone() for o in out_first]
    runner.run(second)  # same bucket: the static output is overwritten
    assert runner.stats.num_replays == replays + 2 and len(runner.stats.captured) == len(runner.buckets)
    for o, k, e in zip(out_first, kept, _eager(tower, first)):
        assert torch.equal(o, k)
        torch.testing.assert_close(o, e)


def test_beyond_the_largest_bucket_runs_eagerly(tower):
    runner = _runner(tower, default_encoder_buckets(64, 2, 2 if tower.cfg.is_qwen2_5 else 1, 4, min_tokens=64))
    encode = graphed_encode_fn(runner, lambda payloads: _eager(tower, payloads))
    payloads = _items(np.random.default_rng(4), [(1, 10, 10)])  # 100 tokens > every bucket
    assert runner.run(payloads) is None
    for g, e in zip(encode(payloads), _eager(tower, payloads)):
        assert torch.equal(g, e)
    assert runner.stats.num_eager_batches == 2 and runner.stats.num_replays == 0


def test_memory_budget_stops_capturing_larger_buckets(tower, monkeypatch):
    """CUDA measures reserved bytes; here a fake meter charges 100 bytes per capture."""
    captures = []

    class Meter:
        def __init__(self, device):
            pass

        def used_bytes(self):
            return 100 * len(captures)

    monkeypatch.setattr(encoder_graphs, "GraphMemoryMeter", Meter)
    adapter = Qwen2VisionGraphAdapter(tower)
    kinds = len(adapter.attention_kinds)
    buckets = [EncoderBucket(t, (2,) * kinds) for t in (64, 128, 256)]
    runner = EncoderGraphRunner(adapter, buckets, CPU, memory_budget_bytes=250)
    original = runner._capture
    monkeypatch.setattr(runner, "_capture", lambda b: captures.append(b) or original(b))
    stats = runner.capture_all()
    assert stats.captured == buckets[:2] and stats.skipped_over_budget == buckets[2:]
    assert stats.capture_bytes == 200
    payloads = _items(np.random.default_rng(5), [(1, 12, 12)])  # 144 tokens: only the dropped bucket holds it
    assert runner.run(payloads) is None


def test_a_moved_static_buffer_is_caught_before_replay(tower):
    runner = _runner(tower, [EncoderBucket(128, (4,) * (2 if tower.cfg.is_qwen2_5 else 1))])
    payloads = _items(np.random.default_rng(6), [(1, 8, 8)])
    bucket = runner.plan(runner.adapter.layout(payloads)).bucket
    buffers = runner.graphs[bucket].buffers
    buffers.tensors["pixel_values"] = buffers["pixel_values"].clone()  # rebound: the graph holds the old address
    with pytest.raises(RuntimeError, match="pixel_values.*moved"):
        runner.run(payloads)


def test_static_buffers_bookkeeping():
    buffers = StaticBuffers({"x": torch.zeros(4, 2), "cu": torch.zeros(3, dtype=torch.int32)})
    with pytest.raises(RuntimeError, match="before capture"):
        buffers.assert_unmoved()
    buffers.record()
    buffers.load("x", torch.ones(3, 2))  # leading rows, in place
    buffers.assert_unmoved()
    assert buffers["x"].sum().item() == 6 and buffers.nbytes == 4 * 2 * 4 + 3 * 4
    with pytest.raises(ValueError, match="cannot hold"):
        buffers.load("x", torch.ones(5, 2))
    with pytest.raises(ValueError, match="cannot hold"):
        buffers.load("x", torch.ones(2, 3))
    buffers["cu"].set_(torch.zeros(3, dtype=torch.int32))  # new storage under the same tensor
    with pytest.raises(RuntimeError, match="'cu' moved"):
        buffers.assert_unmoved()


def test_replay_equivalent_overwrites_its_static_output():
    source = torch.tensor([1.0, 2.0])
    graph = ReplayEquivalent(lambda: source * 2)
    output = graph.output
    source.copy_(torch.tensor([5.0, 6.0]))
    graph.replay()
    assert graph.output is output and output.tolist() == [10.0, 12.0]


def test_buckets_must_suit_the_tower(tower):
    adapter = Qwen2VisionGraphAdapter(tower)
    with pytest.raises(ValueError, match="multiple of 4"):
        EncoderGraphRunner(adapter, [EncoderBucket(66, (2,) * len(adapter.attention_kinds))], CPU)


def test_capture_plan_is_a_valid_layout():
    plan = capture_plan(EncoderBucket(64, (4, 16)))
    assert [sum(c) for c in plan.context_tokens] == [64, 64]
    assert [len(c) for c in plan.context_tokens] == [4, 16] and min(min(c) for c in plan.context_tokens) == 1


def test_buckets_share_one_set_of_static_inputs(captured):
    runner = captured
    small, large = runner.graphs[runner.buckets[0]].buffers, runner.graphs[runner.buckets[-1]].buffers
    assert small["pixel_values"].shape[0] < large["pixel_values"].shape[0]
    for name in small.tensors:
        assert small[name].data_ptr() == large[name].data_ptr()  # leading rows of the same storage


def test_decode_graphs_skip_buckets_beyond_the_key_cap():
    from types import SimpleNamespace

    from mmserve.runner.graphs.buckets import DecodeBucket
    from mmserve.runner.graphs.decode_graphs import DecodeGraphRunner, DecodeGraphSettings

    settings = DecodeGraphSettings((1, 8), (4, 64), scratch_block=0, num_position_rows=3, max_keys=4096)
    runner = DecodeGraphRunner(None, SimpleNamespace(block_size=16), settings, CPU)
    assert runner.buckets == [DecodeBucket(1, 4), DecodeBucket(1, 64), DecodeBucket(8, 4)]  # 8 x 64 x 16 > 4096


def _resolve(**kwargs):
    from mmserve.config import EngineConfig
    from mmserve.engine.graph_settings import resolve_runner_graphs

    config = EngineConfig.from_kwargs("model", **kwargs)
    return resolve_runner_graphs(config, encoder_tokens_per_step=16384, encoder_items_per_step=16, num_kv_blocks=100,
                                 max_model_len=1000, num_position_rows=3)


def test_graph_engine_args_resolve_per_device():
    cpu, cuda = _resolve(), _resolve(device="cuda:0", max_num_seqs=20)
    assert cpu.encoder is None and cpu.decode is None and cpu.num_scratch_blocks == 0  # off on the CPU by default
    assert cuda.encoder.max_tokens_per_step == 16384 and cuda.encoder.buckets is None
    assert cuda.decode.batch_sizes == (1, 2, 4, 8, 16, 20) and cuda.decode.block_widths == (4, 8, 16, 32, 63)
    assert cuda.decode.scratch_block == 100 and cuda.num_scratch_blocks == 1  # the block after the managed ones
    off = _resolve(device="cuda", enable_encoder_cuda_graphs=False, enable_decode_cuda_graphs=False)
    assert off.encoder is None and off.decode is None
    chosen = _resolve(device="cuda", encoder_graph_buckets=((1024, 8),), decode_graph_batch_sizes=(8, 1))
    assert chosen.encoder.buckets == ((1024, 8),) and chosen.decode.batch_sizes == (1, 8)
    assert _resolve(device="cuda", encoder_workers=2).encoder is None  # the workers encode, eagerly


@pytest.mark.parametrize("bad", [dict(encoder_graph_memory_bytes=0), dict(decode_graph_batch_sizes=(0, 4)),
                                 dict(encoder_graph_buckets=((1024,),))])
def test_graph_engine_args_are_validated(bad):
    from mmserve.config import EngineConfig

    with pytest.raises(ValueError):
        EngineConfig.from_kwargs("model", **bad)
