"""A burst of clients against ``python -m mlx_batched_decode.serve`` (both engines), as a new
user's load comes: 8 requests with long prompts, then, 1 s later, 64 short completions whose
clients all connect at the same moment (``tests.support.server_burst``).

Connections arrive faster than the accept loop takes them, so the listen backlog must hold the
burst: with socketserver's backlog of 5 (mlx-lm's) most of these clients are reset or time out.
Every request must be answered (HTTP 200 with a completion). How long the plug-in's server takes
against mlx-lm's server with the same backlog is measured by ``benchmarks/bench_server.py --burst``
(docs/benchmarks.md, "A burst of clients"). The model folder is the server test's; every server
is on 127.0.0.1 and always stopped.
"""

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
from mlx_batched_decode.tools.model_folder import save_model_folder  # noqa: E402
from tests.support.mlx_lm_models import SERVED_LLAMA_SLIDING as CONFIG  # noqa: E402
from tests.support.server_burst import BURST, new_user_burst  # noqa: E402

VOCAB = CONFIG["vocab_size"]
# Bounds every request; a client left in SYN retries by a full backlog gives up here.
REQUEST_TIMEOUT_S = 60.0
STARTUP_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 20.0
ARGS = ["--log-level", "WARNING"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_folder(CONFIG, tmp_path_factory.mktemp("model"), seed=3)


def test_listen_backlog_holds_a_batch_and_a_floor():
    assert listen_backlog(1) == listen_backlog(32) == MIN_LISTEN_BACKLOG >= 128
    assert listen_backlog(200) == 400
    assert server_class(32).request_queue_size == MIN_LISTEN_BACKLOG


def test_plugin_server_answers_a_burst_of_clients(model_dir, tmp_path):
    command = [sys.executable, "-m", "mlx_batched_decode.serve", "--engine", "mlx-lm",
               "--model", str(model_dir), *ARGS]
    log = tmp_path / "plug-in.log"
    with running_server(command, log, STARTUP_TIMEOUT_S, STOP_TIMEOUT_S) as (port, _):
        result = new_user_burst(port, VOCAB, REQUEST_TIMEOUT_S)
    assert not result.failed, result.summary()
    # The burst's decode steps ran on the op.
    served = re.search(r"batched_decode_attention served (\d+)", log.read_text())
    assert served and int(served.group(1)) > 0, log.read_text()


def test_native_server_answers_a_burst_of_clients(model_dir, tmp_path):
    """The native server, its batch and queue holding every client of the burst: all answered
    while the long prompts are prefilled beside the short ones' decode steps."""
    command = [sys.executable, "-m", "mlx_batched_decode.serve", "--model", str(model_dir),
               "--max-batch-size", "8", "--max-queue", str(BURST), *ARGS]
    with running_server(command, tmp_path / "native.log", STARTUP_TIMEOUT_S,
                        STOP_TIMEOUT_S) as (port, _):
        result = new_user_burst(port, VOCAB, REQUEST_TIMEOUT_S)
    assert not result.failed, result.summary()
