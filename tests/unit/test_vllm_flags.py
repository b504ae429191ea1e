"""vLLM's `vllm serve` flags and `LLM(...)` arguments, walked from vllm_args.py's table: every row parses
(never argparse's "unrecognized arguments"); a refused row stops start-up with its reason; an accepted row
takes the values that mean what mmserve does and refuses the others; a working row or an alias changes
what the command runs with (and, for an engine argument, the engine's config); offline, `LLM(**kwargs)`
reads the same table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmserve.config import TOP_LEVEL_ARGS, CacheConfig, EngineConfig
from mmserve.engine.generation_defaults import generation_defaults, with_defaults
from mmserve.engine.sizing import resolve_max_model_len, resolve_num_kv_blocks
from mmserve.entrypoints import cli, cli_args
from mmserve.envs import ALLOW_LONG_MAX_MODEL_LEN, VLLM_ALLOW_LONG_MAX_MODEL_LEN
from mmserve.errors import InvalidInputError
from mmserve.sampling_params import SamplingParams
from mmserve.vllm_args import BY_NAME, VLLM_ARGS, Support, docs_page, markdown_table, resolve_dtype

ROWS = {row.name: row for row in VLLM_ARGS}


def _serve(*argv):
    return cli_args.build_parser().parse_args(["serve", *argv])


def _argv(row, value=None):
    if row.switch:
        return [row.flag]
    return [row.flag, *(value if value is not None else row.example or ("x",))]


@pytest.mark.parametrize("name", [r.name for r in VLLM_ARGS if r.support is Support.REFUSED])
def test_a_refused_flag_stops_start_up_saying_why(name, capsys):
    row = ROWS[name]
    with pytest.raises(SystemExit) as stopped:
        _serve(*_argv(row))
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert row.refusal() in err.replace("\n", " ") or row.refusal() in err
    assert "unrecognized arguments" not in err


@pytest.mark.parametrize("name", [r.name for r in VLLM_ARGS if r.support is Support.ACCEPTED])
def test_an_accepted_flag_takes_what_mmserve_does_and_refuses_the_rest(name, capsys):
    row = ROWS[name]
    baseline = vars(_serve())
    for value in row.accepted_values or ("anything",):
        parsed = vars(_serve(*_argv(row, (value,))))
        changed = {k for k in parsed if parsed[k] != baseline.get(k)}
        assert changed <= ({row.name} if row.name in TOP_LEVEL_ARGS else set()), changed
    if row.accepted_values:
        with pytest.raises(SystemExit):
            _serve(*_argv(row, ("something-else",)))
        err = capsys.readouterr().err
        assert f"{row.flag} something-else: mmserve supports only" in err and row.note[:30] in err


@pytest.mark.parametrize("name", [r.name for r in VLLM_ARGS if r.support in (Support.WORKS, Support.ALIAS)])
def test_a_working_flag_changes_what_serve_runs_with(name):
    row = ROWS[name]
    baseline, parsed = vars(_serve()), vars(_serve(*_argv(row)))
    assert parsed != baseline, f"{row.flag} changed nothing"
    if row.server_only or row.name == "model":
        return
    extra = ["--device", "cuda"] if name == "gpu_memory_utilization" else []
    # a switch that is on by default is compared with its --no- form
    off = [row.flag.replace("--", "--no-", 1)] if row.switch else []
    before = EngineConfig.from_kwargs("m", **cli_args.engine_kwargs(_serve(*extra, *off)))
    after = EngineConfig.from_kwargs("m", **cli_args.engine_kwargs(_serve(*extra, *_argv(row))))
    assert after != before, f"{row.flag} did not reach the engine's config"


def test_short_spellings_and_served_model_names():
    assert _serve("-tp", "1").command == "serve"
    args = _serve("--served-model-name", "first", "second")
    assert args.served_model_name == ["first", "second"]


def test_the_docs_table_lists_every_row():
    table = markdown_table()
    assert all(f"`{row.flag}`" in table for row in VLLM_ARGS)
    assert len(BY_NAME) == len(VLLM_ARGS), "a row is listed twice"


def test_offline_arguments_read_the_same_table():
    config = EngineConfig.from_kwargs("m", tensor_parallel_size=1, trust_remote_code=True, num_gpu_blocks_override=9,
                                      dtype="half", disable_log_stats=True)
    assert config.cache.num_kv_blocks == 9 and config.dtype == "float16" and config.trust_remote_code
    with pytest.raises(InvalidInputError, match="tensor-parallel-size 2: mmserve supports only 1") as refused:
        EngineConfig.from_kwargs("m", tensor_parallel_size=2)
    assert refused.value.param == "tensor_parallel_size"
    with pytest.raises(InvalidInputError, match="no LoRA") as refused:
        EngineConfig.from_kwargs("m", enable_lora=True)
    assert refused.value.param == "enable_lora"
    with pytest.raises(InvalidInputError, match="server flag"):
        EngineConfig.from_kwargs("m", api_key="k")


def test_gpu_memory_utilization_is_refused_on_the_cpu_and_beside_another_kv_size():
    with pytest.raises(ValueError, match="on the cpu give kv_cache_bytes"):
        EngineConfig.from_kwargs("m", device="cpu", gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match="give one of gpu_memory_utilization"):
        EngineConfig.from_kwargs("m", device="cuda", gpu_memory_utilization=0.5, kv_cache_bytes=2**20)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        EngineConfig.from_kwargs("m", device="cuda", gpu_memory_utilization=1.5)


def test_enforce_eager_turns_every_graph_off_and_refuses_one_asked_on():
    graphs = EngineConfig.from_kwargs("m", enforce_eager=True).graphs
    assert not graphs.encoder_graphs_on("cuda") and not graphs.decode_graphs_on("cuda")
    assert graphs.cpu_decode_compile("cpu", "auto") == "off" and not graphs.decode_graphs_on("cpu")
    with pytest.raises(ValueError, match="enforce_eager runs every step eagerly"):
        EngineConfig.from_kwargs("m", enforce_eager=True, compile_cpu_decode=True)


def test_dtype_auto_is_the_checkpoints(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"torch_dtype": "bfloat16"}}))
    assert resolve_dtype("auto", str(tmp_path), "cpu") == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    assert resolve_dtype("auto", str(tmp_path), "cpu") == "float32"
    assert resolve_dtype("auto", str(tmp_path), "cuda:0") == "float16"
    assert resolve_dtype("half", str(tmp_path), "cpu") == "float16"


def test_limit_mm_per_prompt_takes_vllms_json():
    assert cli._limit_per_prompt('{"image": 2, "video": 0}') == {"image": 2, "video": 0}
    assert cli._limit_per_prompt("image=3") == {"image": 3}
    assert cli._limit_per_prompt('{"audio": 1}') == {"audio": 1}
    assert cli._limit_per_prompt("audio=2,image=1") == {"audio": 2, "image": 1}
    assert cli._limit_per_prompt("") == {}  # every kind keeps its default
    for refused in ('{"speech": 1}', '{"audio": -1}', '{"audio": true}', "audio=x", "[1]"):
        with pytest.raises(InvalidInputError):
            cli._limit_per_prompt(refused)


def test_max_model_len_past_the_positions_needs_the_environment(monkeypatch):
    monkeypatch.delenv(ALLOW_LONG_MAX_MODEL_LEN, raising=False)
    monkeypatch.delenv(VLLM_ALLOW_LONG_MAX_MODEL_LEN, raising=False)
    with pytest.raises(InvalidInputError, match="longer than the model's 2048 positions") as refused:
        resolve_max_model_len(4096, 2048, 10_000)
    assert refused.value.param == "max_model_len" and VLLM_ALLOW_LONG_MAX_MODEL_LEN in str(refused.value)
    assert resolve_max_model_len(2048, 2048, 10_000) == 2048
    for name in (ALLOW_LONG_MAX_MODEL_LEN, VLLM_ALLOW_LONG_MAX_MODEL_LEN):
        monkeypatch.setenv(name, "1")
        assert resolve_max_model_len(4096, 2048, 10_000) == 4096
        monkeypatch.delenv(name)


def test_generation_defaults_fill_only_what_a_request_left_unset(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.3, "max_new_tokens": 8, "do_sample": True}))
    defaults = generation_defaults(str(tmp_path), "auto")
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.3, "max_tokens": 8}
    assert generation_defaults(str(tmp_path), "vllm") == {}
    params = SamplingParams(temperature=0.0, max_tokens=100)
    filled = with_defaults(params, ["top_p", "repetition_penalty", "max_tokens"], defaults)
    assert (filled.temperature, filled.top_p, filled.repetition_penalty, filled.max_tokens) == (0.0, 0.9, 1.3, 8)
    assert with_defaults(params, [], defaults) is params
    # max_new_tokens only lowers the room a request has, never under its min_tokens
    assert with_defaults(SamplingParams(max_tokens=5), ["max_tokens"], defaults).max_tokens == 5
    assert with_defaults(SamplingParams(max_tokens=50, min_tokens=20), ["max_tokens"], defaults).max_tokens == 20


def test_the_docs_page_is_the_table():
    page = (Path(__file__).resolve().parents[2] / "docs" / "vllm-flags.md").read_text()
    assert page == docs_page(), "regenerate docs/vllm-flags.md (the command is on the page)"


def test_gpu_memory_utilization_gives_the_kv_cache_what_the_fraction_leaves(monkeypatch):
    """On CUDA (the device's memory figures planted): 0.5 of 80 GiB with 10 GiB in use leaves 40 - 10 - 2
    (the activation share) = 28 GiB for the KV cache; a fraction under what is in use is refused."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 80 * gib))
    cache = CacheConfig(gpu_memory_utilization=0.5)
    per_token = 1024
    blocks = resolve_num_kv_blocks(cache, per_token, torch.device("cuda"))
    assert blocks == int(28 * gib) // (per_token * cache.block_size)
    with pytest.raises(ValueError, match="already in use"):
        resolve_num_kv_blocks(CacheConfig(gpu_memory_utilization=0.1), per_token, torch.device("cuda"))
    # on the CPU the config refuses it before this is reached; kv_cache_bytes sizes the cache there
    assert resolve_num_kv_blocks(CacheConfig(kv_cache_bytes=2**20), 64, torch.device("cpu")) == 2**20 // (64 * 16)


def test_a_model_read_as_a_served_name_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_log_to_stderr", lambda level: None)  # no handler left on a captured stream
    assert cli.main(["serve", "--served-model-name", "qwen", str(tmp_path)]) == 2
    assert f"--served-model-name read '{tmp_path}' as a name; write MODEL before" in capsys.readouterr().err


def test_a_generation_config_default_out_of_range_fails_at_start(tmp_path):
    from mmserve.errors import ModelLoadError

    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(ModelLoadError, match="top_p"):
        generation_defaults(str(tmp_path), "auto")
    assert generation_defaults(str(tmp_path), "vllm") == {}
