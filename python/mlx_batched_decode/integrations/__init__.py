"""What connects the package to other software: the mlx-lm plug-in (``mlx_lm``, public as
``mlx_batched_decode.mlx_lm``; its server behind ``python -m mlx_batched_decode.serve``) and
tensor parallelism over ``mx.distributed`` (``tensor_parallel``)."""
