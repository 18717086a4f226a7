"""What is replaced in mlx-lm, for the decoder's steps and for the plug-in, and the switch.

mlx-lm's files are never edited; names are rebound in memory:

- ``scaled_dot_product_attention``, in a module that imported it, by a ``RoutedAttention``
  (``standard``): the decoder rebinds it in the model's modules (``mlx_lm_attention_modules``)
  for one step, the plug-in in ``mlx_lm.models.base`` and every loaded module binding it;
- the ``__call__`` of the attention classes in ``CLASS_CALLS``, which do not attend through that
  function in a way the router can serve: Gemma 2's (``gemma2``), for both; the MLA layers'
  (``mla``) for the plug-in only, the decoder's step cache serving them through the function.

``step_patches`` and ``plugin_patches`` list them as ``Patch`` records; ``apply`` puts them in
force and returns what they replaced, which ``undo`` puts back. The plug-in adds patches of its
own (its batch caches' ``make_mask``) to the same switch.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, NamedTuple, Sequence

import mlx.nn as nn

from .gemma2 import attention_call
from .mla import latent_call
from .standard import ATTENTION_FUNCTION, RoutedAttention, modules_binding


class Patch(NamedTuple):
    """``owner.name = value``; ``owner`` a module or a class that defines ``name`` itself."""

    owner: Any
    name: str
    value: Any


class ClassCall(NamedTuple):
    """An mlx-lm attention class whose ``__call__`` is replaced.

    Attributes:
        module: the mlx-lm module that defines it.
        name: the class's name there.
        make: ``(router, original __call__) -> the replacement``.
        decoder: replaced during the decoder's steps too, not only while the plug-in is on.
    """

    module: str
    name: str
    make: Callable[[RoutedAttention, Callable], Callable]
    decoder: bool

    def patch(self, router: RoutedAttention, module: Any) -> Patch:
        """The ``Patch`` of this class of ``module`` (the loaded ``self.module``) for ``router``."""
        cls = getattr(module, self.name)
        return Patch(cls, "__call__", self.make(router, vars(cls)["__call__"]))


CLASS_CALLS = (
    ClassCall("mlx_lm.models.gemma2", "Attention", lambda router, _: attention_call(router), True),
    ClassCall("mlx_lm.models.deepseek_v3", "DeepseekV3Attention", latent_call, False),
    ClassCall("mlx_lm.models.glm4_moe_lite", "Glm4MoeLiteAttention", latent_call, False),
)
_DECODER_CALLS = {call.module: call for call in CLASS_CALLS if call.decoder}


def apply(patches: Sequence[Patch]) -> list[Patch]:
    """Puts ``patches`` in force, in order; returns what they replaced, for ``undo``. All or
    none: a patch that fails undoes those before it."""
    replaced: list[Patch] = []
    try:
        for patch in patches:
            original = vars(patch.owner)[patch.name]
            setattr(patch.owner, patch.name, patch.value)
            replaced.append(Patch(patch.owner, patch.name, original))
    except BaseException:
        undo(replaced)
        raise
    return replaced


def undo(replaced: Sequence[Patch]) -> None:
    """Puts back what ``apply`` returned, last first."""
    for patch in reversed(replaced):
        setattr(patch.owner, patch.name, patch.value)


def mlx_lm_attention_modules(model: nn.Module) -> list[Any]:
    """The Python modules of ``model``'s layers that call mlx-lm's
    ``scaled_dot_product_attention`` or whose attention class the decoder's steps replace."""
    from mlx_lm.models import base

    found = {}
    for _, module in model.named_modules():
        python_module = sys.modules.get(type(module).__module__)
        if python_module is not None and (
            python_module.__name__ in _DECODER_CALLS
            or getattr(python_module, ATTENTION_FUNCTION, None) is base.scaled_dot_product_attention
        ):
            found[python_module.__name__] = python_module
    if not found:
        raise ValueError(
            f"[BatchedDecoder] {type(model).__name__} does not call mlx-lm's "
            "scaled_dot_product_attention: it cannot be routed to batched decode attention"
        )
    return list(found.values())


def step_patches(router: RoutedAttention, python_modules: Sequence[Any]) -> list[Patch]:
    """A decoder step's: in each of a model's modules (``mlx_lm_attention_modules``), its
    attention class's ``__call__`` where ``CLASS_CALLS`` replaces it for the decoder, else its
    ``scaled_dot_product_attention``, by ``router``."""
    patches = []
    for python_module in python_modules:
        call = _DECODER_CALLS.get(python_module.__name__)
        if call is None:
            patches.append(Patch(python_module, ATTENTION_FUNCTION, router))
        else:
            patches.append(call.patch(router, python_module))
    return patches


def plugin_patches(router: RoutedAttention) -> list[Patch]:
    """The plug-in's: every class of ``CLASS_CALLS``, and ``scaled_dot_product_attention`` in
    every loaded module binding ``router.original`` (``base`` among them)."""
    calls = [call.patch(router, importlib.import_module(call.module)) for call in CLASS_CALLS]
    # Listed after the imports above, so that those modules' binding is replaced too.
    bindings = modules_binding(router.original)
    return calls + [Patch(module, ATTENTION_FUNCTION, router) for module in bindings]
