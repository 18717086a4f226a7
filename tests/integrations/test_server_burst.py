"""A burst of clients against ``python -m mlx_batched_decode.serve`` (both engines), as a new
user's load comes: 8 requests with long prompts, then, 1 s later, 64 short completions whose
clients all connect at the same moment.

Connections arrive faster than the accept loop takes them, so the listen backlog must hold the
burst: with socketserver's backlog of 5 (mlx-lm's) most of these clients are reset or time out.
Every request must be answered (HTTP 200 with a completion), and the plug-in's server must take
no more than 1.5x as long as mlx-lm's server with the same backlog and no plug-in (stock
``mlx_lm.server`` drops most of the burst, so it cannot be the yardstick). The servers run in
turns (plug-in, mlx-lm, mlx-lm, plug-in) so that other load on the machine weighs on both alike.
The model folder is the server test's; every server is on 127.0.0.1 and always stopped.
"""

import random
import re
import sys

import pytest

pytest.importorskip("mlx_lm")

from mlx_batched_decode.integrations.mlx_lm.listen_backlog import (  # noqa: E402
    MIN_LISTEN_BACKLOG,
    listen_backlog,
    server_class,
)
from mlx_batched_decode.tools.local_server import running_server  # noqa: E402
from mlx_batched_decode.tools.model_folder import SPECIAL_TOKENS, save_model_folder, word  # noqa: E402
from tests.integrations.test_server import CONFIG, VOCAB  # noqa: E402
from tests.support.repo import REPO  # noqa: E402
from tests.support.server_burst import burst  # noqa: E402

LONG_REQUESTS = 8
LONG_PROMPT_TOKENS = 1500
LONG_MAX_TOKENS = 16
BURST = 64
SHORT_MAX_TOKENS = 2
PAUSE_S = 1.0
# Bounds every request; a client left in SYN retries by a full backlog gives up here.
REQUEST_TIMEOUT_S = 60.0
STARTUP_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 20.0
MAX_SLOWDOWN = 1.5
ARGS = ["--log-level", "WARNING"]
SERVERS = {
    "plug-in": [sys.executable, "-m", "mlx_batched_decode.serve", "--engine", "mlx-lm"],
    "mlx-lm": [sys.executable, str(REPO / "tests" / "support" / "mlx_lm_server_backlog.py")],
}
TURNS = ["plug-in", "mlx-lm", "mlx-lm", "plug-in"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_folder(CONFIG, tmp_path_factory.mktemp("model"), seed=3)


def _prompts():
    """The long prompts and the burst's short ones: seeded random words, one token each."""
    rng = random.Random(0)
    words = range(len(SPECIAL_TOKENS), VOCAB)

    def text(n):
        return " ".join(word(rng.choice(words)) for _ in range(n))

    long_prompts = [text(LONG_PROMPT_TOKENS) for _ in range(LONG_REQUESTS)]
    return long_prompts, [text(3 + i % 5) for i in range(BURST)]


def test_listen_backlog_holds_a_batch_and_a_floor():
    assert listen_backlog(1) == listen_backlog(32) == MIN_LISTEN_BACKLOG >= 128
    assert listen_backlog(200) == 400
    assert server_class(32).request_queue_size == MIN_LISTEN_BACKLOG


def test_plugin_server_answers_a_burst_of_clients(model_dir, tmp_path):
    long_prompts, short_prompts = _prompts()
    walls = {name: 0.0 for name in SERVERS}
    for turn, name in enumerate(TURNS):
        command = [*SERVERS[name], "--model", str(model_dir), *ARGS]
        log = tmp_path / f"{turn}-{name}.log"
        with running_server(command, log, STARTUP_TIMEOUT_S, STOP_TIMEOUT_S) as (port, _):
            result = burst(
                port,
                long_prompts,
                LONG_MAX_TOKENS,
                short_prompts,
                SHORT_MAX_TOKENS,
                PAUSE_S,
                REQUEST_TIMEOUT_S,
            )
        failed = len(result.failed)
        assert failed == 0, f"{name} server: {result.summary()}"
        walls[name] += result.wall_s
        if name == "plug-in":
            # The burst's decode steps ran on the op.
            served = re.search(r"batched_decode_attention served (\d+)", log.read_text())
            assert served and int(served.group(1)) > 0, log.read_text()
    assert walls["plug-in"] <= MAX_SLOWDOWN * walls["mlx-lm"], f"seconds over both turns: {walls}"


def test_native_server_answers_a_burst_of_clients(model_dir, tmp_path):
    """The native server, its batch and queue holding every client of the burst: all answered
    while the long prompts are prefilled beside the short ones' decode steps."""
    long_prompts, short_prompts = _prompts()
    command = [sys.executable, "-m", "mlx_batched_decode.serve", "--model", str(model_dir),
               "--max-batch-size", "8", "--max-queue", str(BURST), *ARGS]
    with running_server(command, tmp_path / "native.log", STARTUP_TIMEOUT_S,
                        STOP_TIMEOUT_S) as (port, _):
        result = burst(port, long_prompts, LONG_MAX_TOKENS, short_prompts, SHORT_MAX_TOKENS,
                       PAUSE_S, REQUEST_TIMEOUT_S)
    assert not result.failed, result.summary()
