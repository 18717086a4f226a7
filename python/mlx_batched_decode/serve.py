"""mlx-lm's OpenAI-compatible server with the mlx-lm plug-in enabled.

::

    python -m mlx_batched_decode.serve --model path/to/model [any other mlx_lm.server argument]

Takes exactly the arguments of ``mlx_lm.server`` (``--help`` lists them) and runs its ``main()``
after ``mlx_batched_decode.mlx_lm.enable()``: the decode steps of the server's batched path
(``BatchGenerator``, up to ``--decode-concurrency`` requests at once) attend through
``batched_decode_attention``; everything else is mlx-lm's server unchanged, but for its listen
backlog: ``max(128, 2 x --decode-concurrency)`` connections instead of socketserver's 5, so that
clients connecting all at once are queued, not dropped or reset. When it is stopped
(Ctrl-C / SIGINT), it prints how many attention calls the op served and how many stayed on
mlx-lm's path (``mlx_batched_decode.mlx_lm.stats()``), then shuts down as mlx-lm's server does.
"""

from .integrations.mlx_lm.server import main

if __name__ == "__main__":
    main()
