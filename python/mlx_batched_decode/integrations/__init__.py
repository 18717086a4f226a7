"""What connects the package to other software: the mlx-lm plug-in (``mlx_lm``, public as
``mlx_batched_decode.mlx_lm``; its server behind ``python -m mlx_batched_decode.serve``), the
SGLang plug-in (``sglang``, public as ``mlx_batched_decode.sglang``) and tensor parallelism over
``mx.distributed`` (``tensor_parallel``)."""
