"""``KVLayout``: where one model's keys and values live, behind one interface.

A layout has two sides. The scheduler's (host ints only): ``check`` a request against the
capacity, ``admit`` it (with the prompt tokens its cached prefix already holds), ``free`` it,
``register`` its written prompt blocks, ``prepare`` a plan (paged: the rows' block tables) and
report its ``usage``. The runner's: apply a plan's ``releases`` and ``admissions`` to the rows,
build the step's one context and run the model's forward pass over it (``forward``), each layer
reading its cache through its attention path (``attentions``), and hand out every buffer a step
writes (``cache_arrays``). The model's family code is routed once here: which of its modules
call mlx-lm's attention, each layer's window and MLA widths.

Dimension legend: N = tokens of a packed step, R = logit rows, V = vocabulary size.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ...attention.base import DecodeAttention
from ...families.mla import latent_specs
from ...families.patches import mlx_lm_attention_modules
from ...families.step_forward import routed_forward
from ..mlx_lm_caches import layer_windows, prompt_caches
from ..plan import StepPlan
from ..request import Request


class KVLayout(ABC):
    """One model's keys/values and its routed attention; row ``b`` of a step is the plan's.

    Args:
        model: the mlx-lm model.

    A layout sets ``attentions``, each layer's attention path, when it is made.
    """

    attentions: list[DecodeAttention]

    def __init__(self, model: nn.Module):
        self.model = model
        self.routed_modules = mlx_lm_attention_modules(model)
        self.windows = layer_windows(model)
        self.num_layers = len(self.windows)
        self.latents = latent_specs(model)

    # -- the scheduler's side -----------------------------------------------------------------

    def check(self, prompt_len: int, max_tokens: int, n: int = 1) -> None:
        """``ValueError`` unless the layout can ever hold such a request of ``n`` choices (any
        size by default)."""

    def admit(self, request: Request) -> Optional[int]:
        """Take ``request`` in, and room for its forks: the leading prompt tokens its cached
        prefix holds (0 by default), or ``None`` when there is no room for it now (nothing
        done)."""
        return 0

    def fork(self, parent: Request, fork: Request) -> None:
        """``fork`` starts from ``parent``'s fed prompt, in the room ``admit`` kept for it."""

    def drop_fork(self, parent: Request) -> None:
        """One of ``parent``'s forks ends before it starts: the room kept for it goes back."""

    def free(self, uid: int) -> None:
        """Request ``uid`` left: what it held goes back (its row is the runner's release)."""

    def register(self, request: Request) -> None:
        """``request``'s prompt blocks written so far may be shared from now on (paged)."""

    def awaits_shared_blocks(self, request: Request, feeding: Sequence[Request]) -> bool:
        """Whether ``request`` should wait for a prompt being fed (``feeding``) to write the
        blocks it would share (paged prefix sharing); never by default."""
        return False

    def prepare(self, plan: StepPlan) -> None:
        """Make the plan's positions writable and record what the runner needs for them."""

    def usage(self) -> Optional[tuple[int, int]]:
        """(in use, capacity) of what the layout budgets, or ``None`` when it budgets no more
        than rows (the scheduler counts those)."""
        return None

    # -- the runner's side --------------------------------------------------------------------

    @abstractmethod
    def release(self, row: int, last: int, length: int) -> None:
        """Row ``row``'s request left: row ``last``'s (``length`` positions cached) moves
        there, so the rows stay ``0..B-1``."""

    @abstractmethod
    def load(self, row: int, layers_kv: Optional[Sequence[tuple[mx.array, mx.array]]]) -> None:
        """Row ``row`` (the next free one) is a new request's; ``layers_kv``, each layer's
        keys/values ``[1, H_kv, P, D]`` of its first P positions (``None``: none yet; an MLA
        layer's pair is mlx-lm's latent ``[1, 1, P, r]`` and rope keys ``[1, 1, P, R]``)."""

    @abstractmethod
    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Row ``dst`` (the next free one) is a fork's: it starts from row ``src``'s first
        ``length`` positions."""

    @abstractmethod
    def context(
        self, plan: StepPlan, seq_lens: Sequence[int], query_lens: Sequence[int],
        first_chunks: Sequence[tuple[int, int]],
    ) -> Any:
        """The step's one context: row ``b`` feeds ``query_lens[b]`` tokens at positions
        ``seq_lens[b] ..``."""

    @abstractmethod
    def cache_arrays(self) -> list[mx.array]:
        """Every buffer a step writes: evaluating them runs the pending writes of a step whose
        output is never read."""

    def forward(
        self,
        tokens: mx.array,
        plan: StepPlan,
        seq_lens: Sequence[int],
        query_lens: Sequence[int],
        logit_rows: Sequence[int],
        first_chunks: Sequence[tuple[int, int]] = (),
    ) -> mx.array:
        """One packed forward pass: int32 ``tokens [N]``, row ``b``'s ``query_lens[b]`` of them
        at positions ``seq_lens[b] ..`` -> the logits ``[R, V]`` (lazy) of the tokens at packed
        rows ``logit_rows``; every token's keys/values written."""
        context = self.context(plan, seq_lens, query_lens, first_chunks)
        return routed_forward(
            self.model, tokens, context, self.attentions, self.windows, self.routed_modules,
            logit_rows, self.latents,
        )

    def vocab_size(self) -> int:
        """V, the logits one token gets."""
        return self.one_token()[0].shape[-1]

    def one_token(self) -> tuple[mx.array, list[Any]]:
        """One token through mlx-lm's own caches: its logits ``[1, 1, V]`` and the caches."""
        caches = prompt_caches(self.model)
        return self.model(mx.zeros((1, 1), dtype=mx.int32), cache=caches), caches
