"""Tensor parallelism: mlx.launch starts 2 ranks on localhost (ring backend, 127.0.0.1); on a model
sharded with mlx-lm's ``model.shard``, every rank decodes exactly the unsharded model's tokens.

Each launch is bounded in time; on a timeout the launcher's whole process group (it and the ranks
it started) is killed.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys

import pytest

pytest.importorskip("mlx_lm")

from mlx_lm.generate import batch_generate  # noqa: E402

from mlx_batched_decode.decoding.decoder import BatchedDecoder  # noqa: E402
from tests.support.repo import REPO  # noqa: E402
from tests.support.tp_worker import FAMILIES, MAX_TOKENS, Tokenizer, build, prompts  # noqa: E402

RANKS = 2
LAUNCH_TIMEOUT_S = 240
LAUNCHER = pathlib.Path(sys.executable).parent / "mlx.launch"
# Run as a module from the repository root, so that it imports tests.support as the test does.
WORKER = ["-m", "tests.support.tp_worker"]


def _free_port_pair():
    """A port P with P and P + 1 free on 127.0.0.1: the ring backend's ranks listen there."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def launch(*command):
    """Run ``python *command`` on 2 ranks with mlx.launch; returns (returncode, stdout, stderr)."""
    if not LAUNCHER.exists():
        pytest.skip(f"{LAUNCHER} not found")
    process = subprocess.Popen(
        [
            str(LAUNCHER),
            "-n",
            str(RANKS),
            "--backend",
            "ring",
            "--starting-port",
            str(_free_port_pair()),
            "--python",
            sys.executable,
            "--",
            *command,
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=LAUNCH_TIMEOUT_S)
    finally:
        if process.poll() is None:
            # The launcher and the ranks it started share its new process group.
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    return process.returncode, stdout, stderr


def test_sharded_model_gives_every_rank_the_unsharded_tokens(tmp_path):
    returncode, stdout, stderr = launch(*WORKER, str(tmp_path))
    assert returncode == 0, stdout + stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(RANKS)]
    assert [r["rank"] for r in ranks] == list(range(RANKS))
    assert all(r["size"] == RANKS for r in ranks)
    for family, config in FAMILIES.items():
        model = build(family)
        expected = BatchedDecoder(model).generate(prompts(), MAX_TOKENS, max_batch_size=3)
        expected_mlx_lm = batch_generate(
            model, Tokenizer(), prompts(), max_tokens=MAX_TOKENS, return_token_ids=True
        ).token_ids
        heads = config["num_attention_heads"] // RANKS, config["num_key_value_heads"] // RANKS
        for rank in ranks:
            got = rank[family]
            assert got["tokens"] == expected, (family, rank["rank"])
            assert got["plugin_tokens"] == expected_mlx_lm, (family, rank["rank"])
            assert got["plugin_served"] > 0
            # Each rank's op saw only its share of the heads, and its caches hold only those.
            assert got["op_heads"] == [list(heads)]
            assert got["cache_heads"] == heads[1]


def test_main_job_tensor_parallel_prints_the_table_once():
    returncode, stdout, stderr = launch(
        "-m",
        "mlx_batched_decode",
        "--tensor-parallel",
        "--prompt-lens",
        "2",
        "9",
        "33",
        "--max-tokens",
        "6",
    )
    assert returncode == 0, stdout + stderr
    assert stdout.count("model: random-weight Llama") == 1
    assert "sharded over 2 ranks" in stdout
    assert stdout.count("path ") == 1  # the table's header
    for name in ("mlx-batched-decode", "seed-style", "mlx-lm batch_generate"):
        row = next(line for line in stdout.splitlines() if line.startswith(name))
        assert row.split()[-1] == "3/3", row
    assert stdout.count("tensor parallel: 2 ranks; per decode step 8 all-reduces") == 1
    assert (
        stdout.count("OK: every request's tokens equal the unsharded model's single-request") == 1
    )
    assert "FAILED" not in stderr


def test_main_job_tensor_parallel_needs_several_ranks():
    result = subprocess.run(
        [sys.executable, "-m", "mlx_batched_decode", "--tensor-parallel"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "--tensor-parallel needs several processes: start it under mlx.launch" in result.stderr
