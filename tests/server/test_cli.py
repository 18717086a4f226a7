"""The server's engine flags: generated from the engine's configs (names, defaults, choices,
help texts), read back into them, and a bad value or combination refused at start with the
configs' one message, before any model is loaded."""

import dataclasses

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("starlette")

from mlx_batched_decode.decoding.config import (  # noqa: E402
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from mlx_batched_decode.server import cli  # noqa: E402


def parse(*flags):
    return cli.build_parser().parse_args(["--model", "unused", *flags])


def test_every_config_field_is_a_flag_with_its_help():
    parser = cli.build_parser()
    actions = {a.dest: a for a in parser._actions}
    for kind in (CacheConfig, SchedulerConfig, SpeculativeConfig):
        for field in dataclasses.fields(kind):
            action = actions[field.name]
            assert action.option_strings[0] == "--" + field.name.replace("_", "-")
            shown = field.metadata["none"] if action.default is None else action.default
            assert action.help == f"{field.metadata['help']} (default: {shown})"
            assert action.choices == field.metadata.get("choices")


def test_defaults_and_values_reach_the_configs():
    config = cli.engine_config(parse())
    assert config == EngineConfig(
        CacheConfig(), SchedulerConfig(max_step_tokens=128, max_batch_size=8), SpeculativeConfig()
    )
    config = cli.engine_config(parse(
        "--kv-layout", "paged", "--block-size", "8", "--no-prefix-sharing", "--max-kv-blocks",
        "64", "--max-batch-size", "3", "--max-step-tokens", "32", "--num-draft-tokens", "4",
    ))
    assert config.cache == CacheConfig(
        kv_layout="paged", block_size=8, prefix_sharing=False, max_kv_blocks=64
    )
    assert config.scheduler == SchedulerConfig(max_step_tokens=32, max_batch_size=3)
    assert config.speculative.num_draft_tokens == 4 and not config.draft


@pytest.mark.parametrize("flags, message", [
    (["--kv-layout", "paged", "--draft-model", "d"], "does not decode speculatively"),
    (["--kv-layout", "paged", "--kv-bits", "8"], "kv_bits needs kv_layout='slot'"),
    (["--max-batch-size", "0"], "max_batch_size must be >= 1"),
    (["--max-step-tokens", "0"], "max_step_tokens must be >= 1"),
    (["--num-draft-tokens", "0"], "num_draft_tokens must be >= 1"),
    (["--block-size", "0"], "block_size must be >= 1"),
    (["--max-kv-blocks", "0"], "max_kv_blocks must be >= 1"),
])
def test_a_bad_value_or_combination_stops_the_server_with_one_message(flags, message):
    with pytest.raises(SystemExit, match=rf"^{cli.PROG}: \[BatchedDecoder\] .*{message}"):
        cli.build_engine(parse(*flags))


def test_choices_are_the_configs(capsys):
    with pytest.raises(SystemExit):
        parse("--kv-layout", "pages")
    assert "invalid choice: 'pages'" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--min-p", "2"], "min_p must be in"),
    (["--top-k", "-1"], "top_k must be >= 0"),
    (["--top-p", "0"], "top_p must be in"),
    (["--keepalive-interval", "0"], "--keepalive-interval must be > 0"),
])
def test_bad_sampling_defaults_stop_the_server_before_loading(flags, message):
    with pytest.raises(SystemExit, match=rf"^{cli.PROG}: .*{message}"):
        cli.build_engine(parse(*flags))


def test_server_flags_of_mlx_lm_server():
    args = parse("--top-k", "40", "--min-p", "0.05", "--allowed-origins", "http://a,http://b")
    assert (args.top_k, args.min_p) == (40, 0.05)
    assert args.allowed_origins == ["http://a", "http://b"]
    assert parse().allowed_origins == ["*"]
