"""Room in the listen queue of mlx-lm's server for a burst of clients.

mlx-lm's server is a ``ThreadingHTTPServer``, whose ``listen()`` backlog is socketserver's
``request_queue_size = 5``. Clients that connect at the same moment arrive faster than the accept
loop takes them (it starts a thread per connection), so all but about six overflow the queue:
Linux drops their SYN or their handshake's last ACK, they retry after 1, 3, 7, ... s, and some
get a reset once their syncookie is no longer accepted. A burst of 64 clients then loses most of
them, whatever serves their requests.

``wide_listen_backlog()`` makes mlx-lm's ``run()`` build its server from ``server_class(n)``, with
n = ``--decode-concurrency``. mlx-lm 0.32.2's ``run()`` takes a ``server_class`` but does not pass
it on to ``_run_http_server``, which builds the server; so that function is wrapped in memory for
the duration of the ``with`` block (no file of mlx-lm is edited), as the plug-in's patches are.
"""

from __future__ import annotations

from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from typing import Iterator

# A floor, as the burst is not bounded by the batch (mlx-lm queues the requests beyond it) and a
# queued connection costs the kernel a few hundred bytes; Linux caps it at net.core.somaxconn.
MIN_LISTEN_BACKLOG = 128


def listen_backlog(decode_concurrency: int) -> int:
    """Connections the kernel may hold for the accept loop: a full batch's clients connecting at
    once, as many again waiting for its slots, and at least ``MIN_LISTEN_BACKLOG``."""
    return max(MIN_LISTEN_BACKLOG, 2 * decode_concurrency)


def server_class(decode_concurrency: int) -> type[ThreadingHTTPServer]:
    """A ``ThreadingHTTPServer`` subclass listening with ``listen_backlog(decode_concurrency)``."""

    # A class of its own per server: mlx-lm's _run_http_server sets address_family on the class.
    class BurstHTTPServer(ThreadingHTTPServer):
        request_queue_size = listen_backlog(decode_concurrency)

    return BurstHTTPServer


@contextmanager
def wide_listen_backlog() -> Iterator[None]:
    """While in the block, ``mlx_lm.server.run()`` serves with
    ``server_class(--decode-concurrency)``."""
    from mlx_lm import server

    original = server._run_http_server

    def run_http_server(host, port, response_generator, **kwargs):
        kwargs["server_class"] = server_class(response_generator.cli_args.decode_concurrency)
        return original(host, port, response_generator, **kwargs)

    server._run_http_server = run_http_server
    try:
        yield
    finally:
        server._run_http_server = original
