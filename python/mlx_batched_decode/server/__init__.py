"""An OpenAI-compatible HTTP server on ``BatchedDecoder`` (``python -m mlx_batched_decode.serve``).

- ``protocol.py``: request fields checked, response bodies built (mlx_lm.server's format);
- ``text_stream.py``: one request's tokens turned into text (mlx-lm's detokenizer and stops);
- ``engine.py``: the decoding thread, stepping the decoder for the HTTP handlers;
- ``metrics.py``: the Prometheus metrics;
- ``app.py``: the Starlette app, its routes and error bodies;
- ``cli.py``: the flags, the model loaded, uvicorn run.

Needs the ``serve`` extra (``pip install ".[serve]"``: Starlette, uvicorn, prometheus_client)
and mlx-lm.
"""
