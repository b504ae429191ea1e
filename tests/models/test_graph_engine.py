"""The engine with captured graphs on gives the same tokens as with them off, on every device: on the CPU
the graphs are replay-equivalents (runner/graphs/capture.py), so the bucketing, padding, dummy contexts,
static buffers, the decode scratch block and the copy-out run in CI; on CUDA they are real CUDA graphs."""

import numpy as np
import pytest

from mmserve import LLM, SamplingParams
from tests.models.helpers import devices, image_part, random_image, text_part

GREEDY = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
# small captures for the tiny checkpoints: two encoder buckets, decode batches 1-8, contexts up to 256 tokens
GRAPH_ARGS = dict(enable_encoder_cuda_graphs=True, enable_decode_cuda_graphs=True,
                  encoder_graph_buckets=((512, 32), (2048, 64)), decode_graph_batch_sizes=(1, 2, 4, 8))
ENGINE_ARGS = dict(max_num_seqs=8, max_model_len=256)


def _workload():
    rng = np.random.default_rng(7)
    frames = [random_image(rng, 112, 84) for _ in range(4)]
    out = [[{"role": "user", "content": [image_part(random_image(rng, w, h)), text_part("Describe.")]}]
           for w, h in [(90, 60), (224, 224), (57, 311), (64, 64)]]
    out.append([{"role": "user", "content": [image_part(random_image(rng, 120, 120)), text_part("and"),
                                             image_part(random_image(rng, 56, 200)), text_part("Compare.")]}])
    out.append([{"role": "user", "content": [{"type": "video", "video": frames}, text_part("What happens?")]}])
    out += [[{"role": "user", "content": [text_part(t)]}] for t in ("Count to ten.", "Say hi.", "Why?")]
    return out


@pytest.mark.parametrize("device", devices())
def test_graphs_on_and_off_give_the_same_tokens(model_dir, device):
    eager = LLM(str(model_dir), device=device, enable_encoder_cuda_graphs=False, enable_decode_cuda_graphs=False,
                **ENGINE_ARGS)
    graphed = LLM(str(model_dir), device=device, **GRAPH_ARGS, **ENGINE_ARGS)
    want = [o.outputs[0].token_ids for o in eager.chat(_workload(), GREEDY, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in graphed.chat(_workload(), GREEDY, use_tqdm=False)]
    assert got == want
    graphed.check_integrity()
    graphs, off = graphed.engine.inspect().graphs, eager.engine.inspect().graphs
    assert off.encoder is None and off.decode is None
    assert graphs.encoder.num_replays > 0 and graphs.decode.num_replays > 0
    assert len(graphs.decode.captured) == 4 * 3  # batch sizes x block widths 4, 8, 16
    # the decode padding's scratch block lies past the blocks the KV manager hands out
    stats = graphed.get_stats()
    assert graphed.engine.inspect().kv_storage.num_blocks == stats["kv_blocks_total"] + 1
    assert eager.engine.inspect().kv_storage.num_blocks == eager.get_stats()["kv_blocks_total"]


def test_graphs_default_off_on_the_cpu(model_dir):
    llm = LLM(str(model_dir), **ENGINE_ARGS)
    graphs = llm.engine.inspect().graphs
    assert graphs.encoder is None and graphs.decode is None


@pytest.mark.parametrize("compiled", [False, True], ids=["replay", "compiled"])
def test_decode_padding_writes_only_the_scratch_block(model_dir, compiled):
    """Three decodes padded to a batch of four: the step's K/V writes land on the three sequences' new
    slots and on the scratch block, nowhere else — also when the CPU compiles the step (its cache write
    is an operator that mutates the cache in place, not a copy the compiler makes)."""
    llm = LLM(str(model_dir), **GRAPH_ARGS, **ENGINE_ARGS, compile_cpu_decode=compiled)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    for i, text in enumerate(("Hi.", "Count to five.", "Why?")):
        chat = [{"role": "user", "content": [text_part(text)]}]
        engine.add_request(str(i), engine.process_chat(chat), params)
    while len(requests := engine.inspect().runner_requests) < 3 or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in requests.values()):
        engine.step()
    storage = engine.inspect().kv_storage
    block_size = storage.block_size
    # the captures left the padding row's own keys in the scratch block: mark it, so its write shows
    storage.key[:, storage.num_blocks - 1].fill_(1234.0)
    before = storage.key.clone()
    new_slots = {r.block_ids[r.num_computed_tokens // block_size] * block_size + r.num_computed_tokens % block_size
                 for r in requests.values()}
    replays = engine.inspect().graphs.decode.num_replays
    engine.step()
    assert engine.inspect().graphs.decode.num_replays == replays + 1
    changed = (storage.key != before).flatten(3).any(-1).any(0).flatten()  # (num_blocks * block_size,) slots
    scratch = storage.num_blocks - 1
    changed_slots = {int(s) for s in changed.nonzero().flatten()}
    assert new_slots <= changed_slots
    assert changed_slots - new_slots <= set(range(scratch * block_size, (scratch + 1) * block_size))
    assert changed_slots - new_slots  # the padding row did write, to the scratch block


@pytest.mark.parametrize("device", devices())
def test_decode_graphs_for_every_family(served_family, served_model_dir, device):
    """Decode graphs capture the language model alone: every family's, whatever its attention (sliding
    windows, deepstack, GQA). A family without an encoder graph layout encodes eagerly, graphs asked or not."""
    chats = [[{"role": "user", "content": [image_part(random_image(np.random.default_rng(0), 120, 90)),
                                           text_part("Describe.")]}]]
    chats += [[{"role": "user", "content": [text_part(t)]}] for t in ("Hi.", "Count to five.", "Why?")]
    args = dict(device=device, max_num_seqs=4, max_model_len=256)
    want = [o.outputs[0].token_ids for o in LLM(str(served_model_dir), enable_decode_cuda_graphs=False,
                                                 **args).chat(chats, GREEDY, use_tqdm=False)]
    llm = LLM(str(served_model_dir), enable_decode_cuda_graphs=True, decode_graph_batch_sizes=(1, 2, 4),
              enable_encoder_cuda_graphs=True, encoder_graph_buckets=((1024, 8),), **args)
    # a step with a sequence that cross-attends to images (mllama) runs eagerly: the image chat goes alone
    parts = [chats] if llm.engine.spec.cross_attention is None else [chats[:1], chats[1:]]
    assert [o.outputs[0].token_ids for part in parts for o in llm.chat(part, GREEDY, use_tqdm=False)] == want
    graphs = llm.engine.inspect().graphs
    # a hybrid model's state layers decode eagerly, graphs asked or not
    assert graphs.decode is None if llm.engine.spec.eager_decode is not None else graphs.decode.num_replays > 0
    has_layout = served_family in ("qwen2_vl", "qwen2_5_vl")  # the towers with a graph layout
    assert (graphs.encoder is not None) == has_layout
