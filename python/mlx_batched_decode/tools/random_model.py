"""Random-weight mlx-lm models built in place from a config dict: no download, no files."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn


def random_model(config: dict[str, Any], seed: int = 0, dtype: mx.Dtype = mx.float32) -> nn.Module:
    """Build the mlx-lm model class that ``config["model_type"]`` names, with random weights.

    The class is resolved exactly as ``mlx_lm.load`` does (so ``"mistral"`` runs mlx-lm's Llama
    code); ``seed`` fixes the weights.
    """
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model
