"""The CPU's compiled decode step (`compile_cpu_decode`, runner/graphs/decode_graphs.py, runner/cpu/compile.py):
the same greedy tokens as the eager engine for every family (several compiled engines in one process,
each with its own weights), in bfloat16 and over an int8 KV cache; one compile for batch 1 and one for
every other bucket; a float8 KV cache refused. Unasked the step runs eagerly; MMSERVE_COMPILE_CPU_DECODE=1
compiles it in the background while eager steps serve (a failed compile leaves them serving; shutdown stops it). The KV writes landing in place, on the step's slots and
the scratch block only, is tested with the other graph paths (test_graph_engine.py)."""

import logging
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.envs import COMPILE_CPU_DECODE
from mmserve.runner.graphs.decode_graphs import DecodeGraphRunner
from tests.models.helpers import image_part, random_image, text_part

GREEDY = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
ARGS = dict(max_num_seqs=4, max_model_len=256)


def _chats():
    chats = [[{"role": "user", "content": [image_part(random_image(np.random.default_rng(0), 120, 90)),
                                           text_part("Describe.")]}]]
    return chats + [[{"role": "user", "content": [text_part(t)]}] for t in ("Hi.", "Count to five.", "Why?")]


def _served(llm, chats) -> list:
    """The chats' tokens. A step with a sequence that cross-attends to images (mllama) runs eagerly: there
    the image chat goes alone, so that the text chats' decode steps replay."""
    if llm.engine.spec.cross_attention is None:
        return [o.outputs[0].token_ids for o in llm.chat(chats, GREEDY, use_tqdm=False)]
    return [o.outputs[0].token_ids for part in (chats[:1], chats[1:]) for o in llm.chat(part, GREEDY, use_tqdm=False)]


def _compiled_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_compiled_decode_gives_the_eager_tokens_for_every_family(served_family, served_model_dir):
    """Every family's language model compiles without a graph break: the step is one graph for the
    batches of 2 and 4 at every block-table width (their sizes are marked dynamic; batch 1's own compile is
    tested once, below)."""
    want = [o.outputs[0].token_ids for o in LLM(str(served_model_dir), **ARGS).chat(_chats(), GREEDY,
                                                                                     use_tqdm=False)]
    before = _compiled_graphs()
    llm = LLM(str(served_model_dir), compile_cpu_decode=True, decode_graph_batch_sizes=(2, 4), **ARGS)
    if llm.engine.spec.eager_decode is not None:  # state layers or sparse experts: eager, asked or not
        assert llm.engine.inspect().graphs.decode is None and _compiled_graphs() == before
        assert _served(llm, _chats()) == want
        return
    assert _compiled_graphs() - before == 1
    assert len(llm.engine.inspect().graphs.decode.captured) == 2 * 3  # batch sizes x block widths 4, 8, 16
    assert _served(llm, _chats()) == want
    assert llm.engine.inspect().graphs.decode.num_replays > 0  # (a copy as of each call)
    assert _compiled_graphs() - before == 1  # serving compiled nothing more
    llm.check_integrity()


@pytest.mark.parametrize("args", [dict(kv_cache_dtype="int8"), dict(dtype="bfloat16")], ids=["int8_kv", "bfloat16"])
def test_compiled_decode_with_an_int8_kv_cache_and_in_bfloat16(checkpoint_dirs, args):
    """Also: batch 1 gets a compile of its own (the compiler specializes sizes 0 and 1), every other bucket
    shares the other."""
    model_dir, args = checkpoint_dirs["qwen2_vl"], dict(args, **ARGS)
    want = [o.outputs[0].token_ids for o in LLM(str(model_dir), **args).chat(_chats(), GREEDY, use_tqdm=False)]
    before = _compiled_graphs()
    llm = LLM(str(model_dir), compile_cpu_decode=True, decode_graph_batch_sizes=(1, 2, 4), **args)
    assert _compiled_graphs() - before == 2
    assert [o.outputs[0].token_ids for o in llm.chat(_chats(), GREEDY, use_tqdm=False)] == want
    assert llm.engine.inspect().graphs.decode.num_replays > 0
    assert _compiled_graphs() - before == 2


def test_compiled_decode_off_means_eager(checkpoint_dirs):
    llm = LLM(str(checkpoint_dirs["qwen2_vl"]), compile_cpu_decode=True, enable_decode_cuda_graphs=False, **ARGS)
    assert llm.engine.inspect().graphs.decode is None


def test_compiled_decode_refuses_a_float8_kv_cache(checkpoint_dirs):
    with pytest.raises(ValueError, match="compile_cpu_decode does not support kv_cache_dtype='fp8_e4m3'"):
        LLM(str(checkpoint_dirs["qwen2_vl"]), compile_cpu_decode=True, kv_cache_dtype="fp8_e4m3", **ARGS)


@pytest.fixture
def gated_compile(monkeypatch):
    """The engines' background compile waits for `gate` before it builds anything (so a test sees the
    eager steps it serves meanwhile for certain); the environment asks for the background compile."""
    monkeypatch.setenv(COMPILE_CPU_DECODE, "1")
    gate, build = threading.Event(), DecodeGraphRunner._capture_all

    def gated(self):
        gate.wait()  # no deadline: the test opens it, and this fixture's teardown does in any case
        return build(self)
    monkeypatch.setattr(DecodeGraphRunner, "_capture_all", gated)
    yield gate
    gate.set()  # a thread still waiting finishes (or stops) instead of hanging


def test_a_background_compile_serves_eagerly_until_the_compiled_step_replays(checkpoint_dirs, gated_compile):
    """MMSERVE_COMPILE_CPU_DECODE=1: the compiled step without waiting at start: the engine serves
    eagerly while it compiles, then replays it; the answers are the eager ones throughout."""
    model_dir = str(checkpoint_dirs["qwen2_vl"])
    want = [o.outputs[0].token_ids for o in LLM(model_dir, compile_cpu_decode=False, **ARGS).chat(
        _chats(), GREEDY, use_tqdm=False)]
    llm = LLM(model_dir, decode_graph_batch_sizes=(1, 4), **ARGS)
    assert llm.engine.get_stats()["cpu_decode_compile"] == "compiling"
    assert [o.outputs[0].token_ids for o in llm.chat(_chats(), GREEDY, use_tqdm=False)] == want
    assert llm.engine.inspect().graphs.decode.num_replays == 0  # every step ran eagerly
    assert not llm.engine.wait_for_compiled_decode(timeout_s=0.01)
    gated_compile.set()
    assert llm.engine.wait_for_compiled_decode(timeout_s=600)
    stats = llm.engine.inspect().graphs.decode
    assert stats.state == "ready" and len(stats.captured) == 2 * 3 and stats.build_s > 0
    assert llm.engine.get_stats()["cpu_decode_compile"] == "ready"
    assert [o.outputs[0].token_ids for o in llm.chat(_chats(), GREEDY, use_tqdm=False)] == want
    assert llm.engine.inspect().graphs.decode.num_replays > 0
    llm.check_integrity()


def test_a_failed_background_compile_leaves_the_eager_steps_serving(checkpoint_dirs, monkeypatch, caplog):
    monkeypatch.setenv(COMPILE_CPU_DECODE, "1")

    def broken(self):
        raise RuntimeError("the compiler broke")
    monkeypatch.setattr(DecodeGraphRunner, "_capture_all", broken)
    llm = LLM(str(checkpoint_dirs["qwen2_vl"]), **ARGS)
    assert not llm.engine.wait_for_compiled_decode(timeout_s=600)  # returns when it fails: the bound only stops a hang
    assert llm.engine.get_stats()["cpu_decode_compile"] == "failed"
    assert "the compiler broke" in llm.engine.inspect().graphs.decode.error
    assert "compiling in the background failed" in caplog.text
    outputs = llm.chat(_chats(), GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)
    assert llm.engine.inspect().graphs.decode.num_replays == 0
    llm.check_integrity()


def test_shutdown_stops_a_background_compile(checkpoint_dirs, monkeypatch):
    monkeypatch.setenv(COMPILE_CPU_DECODE, "1")
    llm = LLM(str(checkpoint_dirs["qwen2_vl"]), **ARGS)
    assert llm.engine.get_stats()["cpu_decode_compile"] == "compiling"
    llm.shutdown()  # interrupts the compiler where it is and waits for the thread
    assert not llm.engine.wait_for_compiled_decode(timeout_s=0)
    assert llm.engine.get_stats()["cpu_decode_compile"] == "stopped"


EXIT_WHILE_COMPILING = """
import sys, time
from mmserve import LLM
llm = LLM(sys.argv[1], max_model_len=256)
print(llm.generate("Hi.", use_tqdm=False)[0].outputs[0].token_ids[:1])
time.sleep(float(sys.argv[2]))
print(llm.engine.get_stats()["cpu_decode_compile"])
"""


@pytest.mark.slow  # timed: it counts the exits that land while this machine is still compiling
def test_a_process_that_exits_while_compiling_exits_cleanly(checkpoint_dirs, monkeypatch):
    """A short script ends before the background compile does: the compiler is stopped before the
    interpreter finalizes (a compiler tracing through finalization aborted the process). Exits at a few
    points of the compile; those that came after it finished prove nothing and are not counted."""
    monkeypatch.setenv(COMPILE_CPU_DECODE, "1")
    exits_while_compiling = 0
    for seconds in (0.5, 1.5, 2.5, 4.0):
        proc = subprocess.run([sys.executable, "-c", EXIT_WHILE_COMPILING, str(checkpoint_dirs["qwen2_vl"]),
                               str(seconds)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "terminate called" not in proc.stderr and "Fatal Python error" not in proc.stderr
        exits_while_compiling += proc.stdout.split()[-1] == "compiling"
    assert exits_while_compiling >= 2


@pytest.mark.parametrize("env, args, why", [(None, dict(), "the default: eager"),
                                            ("0", dict(), "the environment's switch off"),
                                            ("1", dict(kv_cache_dtype="fp8_e4m3"), "a float8 KV cache")],
                         ids=["default", "env_off", "fp8_kv"])
def test_no_background_compile_where_it_cannot_or_should_not_run(checkpoint_dirs, monkeypatch, caplog, env, args,
                                                                  why):
    caplog.set_level(logging.INFO, logger="mmserve.engine.graph_settings")
    if env is None:
        monkeypatch.delenv(COMPILE_CPU_DECODE, raising=False)
    else:
        monkeypatch.setenv(COMPILE_CPU_DECODE, env)
    llm = LLM(str(checkpoint_dirs["qwen2_vl"]), **args, **ARGS)
    assert llm.engine.get_stats()["cpu_decode_compile"] == "off", why
    assert llm.engine.inspect().graphs.decode is None
    if env is None:  # the start-up log says so, and how to compile
        assert "decode steps: eager on the CPU (compile_cpu_decode=True" in caplog.text
