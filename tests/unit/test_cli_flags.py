"""The command line's engine flags, generated from the config dataclasses: sizes, booleans and the
captured-graph tuples parse into the engine args `EngineConfig.from_kwargs` takes."""

import argparse

import pytest
import torch

from mmserve.config import EngineConfig
from mmserve.entrypoints import cli, cli_args, server_flags
from mmserve.envs import COMPILE_CPU_DECODE
from mmserve.errors import InvalidInputError


def _parse(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    cli_args.add_engine_args(parser)
    return cli_args.engine_kwargs(parser.parse_args(list(argv)))


def test_unset_flags_keep_the_config_defaults_and_the_device_is_cuda_where_there_is_one():
    assert _parse() == {"device": "cuda" if torch.cuda.is_available() else "cpu"}
    assert _parse("--device", "cpu") == {"device": "cpu"}


def test_graph_flags_reach_the_graph_config():
    kwargs = _parse("--decode-graph-batch-sizes", "1,2,4", "--encoder-graph-buckets", "1024x2,4096x8x3",
                    "--no-enable-encoder-cuda-graphs", "--enable-decode-cuda-graphs",
                    "--encoder-graph-memory-bytes", "1GiB", "--encoder-cache-bytes", "64MiB", "--compile-cpu-decode")
    config = EngineConfig.from_kwargs("m", **kwargs)
    assert config.graphs.decode_graph_batch_sizes == (1, 2, 4)
    assert config.graphs.encoder_graph_buckets == ((1024, 2), (4096, 8, 3))
    assert config.graphs.enable_encoder_cuda_graphs is False and config.graphs.enable_decode_cuda_graphs is True
    assert config.graphs.encoder_graph_memory_bytes == 1024**3
    assert config.graphs.compile_cpu_decode is True and config.graphs.decode_graphs_on("cpu")
    assert config.encoder.encoder_cache_bytes == 64 * 1024**2


@pytest.mark.parametrize("flags, value, mode", [((), None, "off"), (("--compile-cpu-decode",), True, "startup"),
                                                (("--no-compile-cpu-decode",), False, "off")],
                         ids=["unset", "on", "off"])
def test_the_compile_flag_chooses_when_the_cpu_decode_step_compiles(flags, value, mode, monkeypatch):
    """Unasked, the CPU's decode step runs eagerly (a compile beside serving slows it); the environment
    can ask for the background compile, which a flag still overrides."""
    monkeypatch.delenv(COMPILE_CPU_DECODE, raising=False)
    graphs = EngineConfig.from_kwargs("m", **_parse(*flags)).graphs
    assert graphs.compile_cpu_decode is value
    assert graphs.cpu_decode_compile("cpu", "auto") == mode
    assert graphs.cpu_decode_compile("cuda", "auto") == "off"  # CUDA captures graphs instead
    assert graphs.decode_graphs_on("cpu") is (mode != "off")
    monkeypatch.setenv(COMPILE_CPU_DECODE, "1")
    assert graphs.cpu_decode_compile("cpu", "auto") == {None: "background", True: "startup", False: "off"}[value]
    monkeypatch.setenv(COMPILE_CPU_DECODE, "0")
    assert graphs.cpu_decode_compile("cpu", "auto") == ("startup" if value else "off")


@pytest.mark.parametrize("flag, value, says", [
    ("--decode-graph-batch-sizes", "1,two", "expected integers separated by commas"),
    ("--encoder-graph-buckets", "1024x,8", "expected entries like 1024x2"),
    ("--encoder-cache-bytes", "lots", "expected an integer or a size like 64MiB"),
])
def test_malformed_values_are_refused_by_the_parser(flag, value, says, capsys):
    with pytest.raises(SystemExit):
        _parse(flag, value)
    assert f"argument {flag}: {says}" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_every_command_takes_the_model_as_positional_or_flag(command, tmp_path):
    parser = cli_args.build_parser()
    extra = ["--prompt", "hi"] if command == "generate" else []
    for argv in ([command, str(tmp_path), *extra], [command, "--model", str(tmp_path), *extra]):
        args = parser.parse_args(argv)
        assert cli_args.resolved_model(args) == str(tmp_path)
    with pytest.raises(InvalidInputError, match="two models given"):
        cli_args.resolved_model(parser.parse_args([command, str(tmp_path), "--model", "other", *extra]))


def test_bare_mmserve_prints_help_and_version_is_known(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert "usage: mmserve" in out and all(c in out for c in ("serve", "generate", "chat"))
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("mmserve ")


def test_serve_help_gives_every_flag_a_line_with_its_choices_and_real_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--kv-cache-dtype {auto,int8,fp8_e4m3}" in text and "--encoder-backend {process,ray}" in text
    assert "(default: 256MiB)" in text  # --kv-cache-bytes: the size it takes, not "automatic"
    assert "default: cuda where it is available, else cpu" in text
    assert text.rstrip().endswith("curl http://127.0.0.1:8000/v1/models")  # ends with the examples
    parser = cli_args.build_parser()
    serve = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith("serve"))
    for action in serve._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings[0]} has no help"


def test_a_tool_call_parser_mmserve_cannot_read_is_refused_before_the_model_loads(capsys, tmp_path):
    assert cli.main(["serve", str(tmp_path / "absent"), "--tool-call-parser", "mistral"]) == 2
    error = capsys.readouterr().err
    assert "--tool-call-parser mistral" in error and "hermes, qwen3_xml, qwen3_coder" in error


def test_the_response_store_flags_reach_the_server_config():
    from types import SimpleNamespace

    parser = cli_args.build_parser()
    args = parser.parse_args(["serve", "m", "--response-store-bytes", "2MiB", "--response-store-max-age", "90"])
    assert (args.response_store_bytes, args.response_store_max_age) == (2 * 1024**2, 90.0)
    media = SimpleNamespace(frontend=SimpleNamespace(config=SimpleNamespace(media=None, runner="generate"),
                                                     spec=SimpleNamespace(default_video_fps=None)))
    config = server_flags.build_server_config(args, "m", media, None, {})
    assert (config.response_store_bytes, config.response_store_age_s) == (2 * 1024**2, 90.0)



def test_a_response_store_limit_that_is_not_positive_is_refused_before_the_model_loads(capsys):
    from mmserve.demo.eval import default_model_dir

    assert cli.main(["serve", str(default_model_dir()), "--response-store-max-age", "0"]) == 2
    assert "--response-store-max-age (0.0)" in capsys.readouterr().err


def test_the_terminal_chat_refuses_the_pooling_runner_before_loading(capsys):
    assert cli.main(["chat", "--runner", "pooling"]) == 2
    assert "--runner pooling is served by mmserve serve" in capsys.readouterr().err
