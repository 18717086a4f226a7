"""The logic of ``python -m mlx_batched_decode.serve``: mlx-lm's server with the plug-in enabled.

``main`` takes exactly the arguments of ``mlx_lm.server`` and runs its ``main()`` after
``enable()``, with a listen backlog that holds a burst of clients (``listen_backlog``); on SIGINT
it prints ``report(stats())``, where the attention calls ran, before mlx-lm's server shuts down.
"""

from __future__ import annotations

import signal
import sys

from . import patches as plugin
from .listen_backlog import wide_listen_backlog
from .routing import PluginStats

PROG = "python -m mlx_batched_decode.serve"


def report(stats: PluginStats) -> str:
    """One line: where the server's attention calls ran."""
    return (
        f"mlx_batched_decode: batched_decode_attention served {stats.served} attention calls "
        f"(BatchKVCache {stats.batch_kv}, BatchRotatingKVCache {stats.batch_rotating}); on "
        f"mlx-lm's path: prefill {stats.prefill}, wrapped rings {stats.rotating_wrapped}, "
        f"other caches {stats.other}, head dims the op does not take {stats.unsupported_shape}, "
        f"additive masks {stats.additive_mask}"
    )


def main(argv: list[str] | None = None) -> None:
    """Run ``mlx_lm.server`` with ``argv`` (default: the command line) and the plug-in on."""
    from mlx_lm import server

    sys.argv = [PROG, *(sys.argv[1:] if argv is None else argv)]

    def report_and_interrupt(signum, frame):
        # Reported when the signal arrives: mlx-lm's shutdown then joins its generation thread
        # and the interpreter its request threads, which may outlast whoever sent the signal.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print(report(plugin.stats()), file=sys.stderr, flush=True)
        signal.default_int_handler(signum, frame)

    plugin.enable()
    print(
        "mlx_batched_decode: mlx_lm.server's batched decode attends with batched_decode_attention",
        file=sys.stderr,
        flush=True,
    )
    previous = signal.signal(signal.SIGINT, report_and_interrupt)
    try:
        with wide_listen_backlog():
            server.main()
    finally:
        signal.signal(signal.SIGINT, previous)
        plugin.disable()

