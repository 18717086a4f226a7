"""An HTTP server process on 127.0.0.1, for the end-to-end test and the server benchmark:
started on a free port, waited for until ``/health`` answers, always stopped; and the chunks of
its streamed answers."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence


def sse_chunks(response: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    """The JSON chunks of an OpenAI-style server-sent event stream, up to ``data: [DONE]``."""
    for line in response:
        if not line.startswith(b"data: "):
            continue
        payload = line[len(b"data: ") :].strip()
        if payload == b"[DONE]":
            return
        yield json.loads(payload)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    """Whether the server on 127.0.0.1:``port`` answers ``GET /health`` with 200."""
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except OSError:
        return False


@contextmanager
def running_server(
    command: Sequence[str], log_path: Path, startup_timeout_s: float, stop_timeout_s: float
) -> Iterator[tuple[int, subprocess.Popen]]:
    """Runs ``command --host 127.0.0.1 --port P`` (an ``mlx_lm.server`` command line), its
    output in ``log_path``, offline; yields ``(P, process)`` once it is healthy.

    Raises ``RuntimeError`` with the log if it exits or is not healthy within
    ``startup_timeout_s``. Always stops it: SIGINT (the server's own clean shutdown), then
    SIGKILL if it has not exited within ``stop_timeout_s``.
    """
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [*command, "--host", "127.0.0.1", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not healthy(port):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start:\n" + Path(log_path).read_text())
            time.sleep(0.2)
        yield port, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(stop_timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
