"""An OpenAI-compatible server on ``BatchedDecoder``, or mlx-lm's server with the plug-in.

::

    python -m mlx_batched_decode.serve --model path/to/model [flags]             # this server
    python -m mlx_batched_decode.serve --engine mlx-lm --model path/to/model ...  # mlx_lm.server

The default engine is the server of ``mlx_batched_decode.server`` (``--help`` lists its flags):
every step carries the running requests' decode tokens and chunks of arriving prompts, with
quantized or paged caches, prefix sharing and speculative decoding. ``--engine mlx-lm`` runs
``mlx_lm.server``'s ``main()`` with every other argument, after
``mlx_batched_decode.mlx_lm.enable()``: its batched decode steps attend through
``batched_decode_attention``, and its listen backlog holds ``max(128, 2 x --decode-concurrency)``
connections. Stopped with SIGINT, it prints how many attention calls the op served
(``mlx_batched_decode.mlx_lm.stats()``).
"""

from .server.cli import main

if __name__ == "__main__":
    main()
