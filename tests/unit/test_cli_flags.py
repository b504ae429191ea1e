"""The command line's engine flags, generated from the config dataclasses: sizes, booleans and the
captured-graph tuples parse into the engine args `EngineConfig.from_kwargs` takes."""

import argparse

import pytest

from mmserve.config import EngineConfig
from mmserve.entrypoints import cli


def _parse(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    cli._add_engine_args(parser)
    return cli._engine_kwargs(parser.parse_args(list(argv)))


def test_unset_flags_keep_the_config_defaults():
    assert _parse() == {}


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


@pytest.mark.parametrize("flag, value, says", [
    ("--decode-graph-batch-sizes", "1,two", "expected integers separated by commas"),
    ("--encoder-graph-buckets", "1024x,8", "expected entries like 1024x2"),
    ("--encoder-cache-bytes", "lots", "expected an integer or a size like 64MiB"),
])
def test_malformed_values_are_refused_by_the_parser(flag, value, says, capsys):
    with pytest.raises(SystemExit):
        _parse(flag, value)
    assert f"argument {flag}: {says}" in capsys.readouterr().err
