"""The main job, ``python -m mlx_batched_decode``, run small."""

import io
import json
import subprocess
import sys

import pytest

pytest.importorskip("mlx_lm")

from mlx_batched_decode.tools.progress import ProgressBar  # noqa: E402
from mlx_batched_decode.tools.random_model import random_model  # noqa: E402
from tests.support.mlx_lm_models import QWEN2  # noqa: E402


def _run_main(*args):
    result = subprocess.run(
        [sys.executable, "-m", "mlx_batched_decode", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_main_job_checks_and_prints_the_table():
    result = _run_main("--prompt-lens", "2", "9", "33", "--max-tokens", "6")
    lines = result.stdout.splitlines()
    rows = {
        name: next(line for line in lines if line.startswith(name))
        for name in ("mlx-batched-decode", "seed-style", "mlx-lm batch_generate")
    }
    for name in ("mlx-batched-decode", "seed-style"):
        assert rows[name].split()[-1] == "3/3", rows[name]
    assert "OK: every request's tokens equal its single-request decode" in result.stdout
    assert "18/18 tokens" in result.stderr  # the progress bar reached the end


@pytest.mark.parametrize("bits", ["8", "4"])
def test_main_job_with_a_quantized_cache(bits):
    """``--kv-bits``: a fourth row, checked against mlx-lm's quantized single-request decode."""
    result = _run_main(
        "--prompt-lens", "2", "9", "33", "--max-tokens", "6", "--kv-bits", bits,
        "--kv-group-size", "32",
    )
    row = next(
        line for line in result.stdout.splitlines() if line.startswith("mlx-batched-decode, ")
    )
    assert row.startswith(f"mlx-batched-decode, {bits}-bit KV") and row.split()[-1] == "3/3", row
    assert f"kv_bits={bits}, kv_group_size=32, quantized_kv_start=0" in result.stdout
    assert "OK: every request's tokens equal its single-request decode" in result.stdout


def test_progress_bar_draws_in_place_and_finishes():
    out = io.StringIO()
    bar = ProgressBar(10, "tokens", width=10, stream=out, interval=3600.0)
    for _ in range(10):
        bar.update()
    bar.close()
    frames = out.getvalue().split("\r")[1:]
    # Throttled: the first update and the final one are drawn, nothing in between.
    assert len(frames) == 2
    assert frames[0].startswith("[#---------] 1/10 tokens")
    assert frames[1].startswith("[##########] 10/10 tokens") and frames[1].endswith("\n")


def test_main_job_with_a_local_model_directory(tmp_path):
    """``--model DIR``: an mlx-lm model directory (config, safetensors, tokenizer)."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    import mlx.core as mx
    from mlx.utils import tree_flatten

    # 64 token ids: the word-level tokenizer's below.
    config = dict(QWEN2, hidden_size=128, vocab_size=64)
    model = random_model(config, seed=2)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp_path / "config.json").write_text(json.dumps(config))
    word_level = tokenizers.models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0")
    tokenizer = tokenizers.Tokenizer(word_level)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="t1", unk_token="t0"
    ).save_pretrained(str(tmp_path))

    result = _run_main("--model", str(tmp_path), "--prompt-lens", "3", "10", "--max-tokens", "8")
    assert f"model: {tmp_path}" in result.stdout
    assert "OK: every request's tokens equal its single-request decode" in result.stdout
