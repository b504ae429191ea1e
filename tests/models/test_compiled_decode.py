"""The CPU's compiled decode step (`compile_cpu_decode`, runner/graphs/decode_graphs.py, runner/cpu/compile.py):
the same greedy tokens as the eager engine for every family (several compiled engines in one process,
each with its own weights), in bfloat16 and over an int8 KV cache; one compile for batch 1 and one for
every other bucket; a float8 KV cache refused. The KV writes landing in place, on the step's slots and
the scratch block only, is tested with the other graph paths (test_graph_engine.py)."""

import numpy as np
import pytest
import torch

from mmserve import LLM, SamplingParams
from tests.models.helpers import image_part, random_image, text_part

GREEDY = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
ARGS = dict(max_num_seqs=4, max_model_len=256)


def _chats():
    chats = [[{"role": "user", "content": [image_part(random_image(np.random.default_rng(0), 120, 90)),
                                           text_part("Describe.")]}]]
    return chats + [[{"role": "user", "content": [text_part(t)]}] for t in ("Hi.", "Count to five.", "Why?")]


def _compiled_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_compiled_decode_gives_the_eager_tokens_for_every_family(served_family, served_model_dir):
    """Every family's language model compiles without a graph break: the step is one graph for batch 1
    and one for the batches of 2 and 4 at every block-table width (their sizes are marked dynamic)."""
    want = [o.outputs[0].token_ids for o in LLM(str(served_model_dir), **ARGS).chat(_chats(), GREEDY,
                                                                                     use_tqdm=False)]
    before = _compiled_graphs()
    llm = LLM(str(served_model_dir), compile_cpu_decode=True, decode_graph_batch_sizes=(1, 2, 4), **ARGS)
    assert _compiled_graphs() - before == 2
    assert len(llm.engine.inspect().graphs.decode.captured) == 3 * 3  # batch sizes x block widths 4, 8, 16
    assert [o.outputs[0].token_ids for o in llm.chat(_chats(), GREEDY, use_tqdm=False)] == want
    assert llm.engine.inspect().graphs.decode.num_replays > 0  # (a copy as of each call)
    assert _compiled_graphs() - before == 2  # serving compiled nothing more
    llm.check_integrity()


@pytest.mark.parametrize("args", [dict(kv_cache_dtype="int8"), dict(dtype="bfloat16")], ids=["int8_kv", "bfloat16"])
def test_compiled_decode_with_an_int8_kv_cache_and_in_bfloat16(checkpoint_dirs, args):
    model_dir, args = checkpoint_dirs["qwen2_vl"], dict(args, **ARGS)
    want = [o.outputs[0].token_ids for o in LLM(str(model_dir), **args).chat(_chats(), GREEDY, use_tqdm=False)]
    llm = LLM(str(model_dir), compile_cpu_decode=True, decode_graph_batch_sizes=(1, 4), **args)
    assert [o.outputs[0].token_ids for o in llm.chat(_chats(), GREEDY, use_tqdm=False)] == want
    assert llm.engine.inspect().graphs.decode.num_replays > 0


def test_compiled_decode_off_means_eager(checkpoint_dirs):
    llm = LLM(str(checkpoint_dirs["qwen2_vl"]), compile_cpu_decode=True, enable_decode_cuda_graphs=False, **ARGS)
    assert llm.engine.inspect().graphs.decode is None


def test_compiled_decode_refuses_a_float8_kv_cache(checkpoint_dirs):
    with pytest.raises(ValueError, match="compile_cpu_decode does not support kv_cache_dtype='fp8_e4m3'"):
        LLM(str(checkpoint_dirs["qwen2_vl"]), compile_cpu_decode=True, kv_cache_dtype="fp8_e4m3", **ARGS)
