"""``mlx_batched_decode.server``: request checks, the decoding thread, tensor-parallel plans,
the server as a process."""
