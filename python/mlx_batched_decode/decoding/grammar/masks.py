"""A step's token bitmasks of the constrained rows, filled on the host in one parallel call.

Dimension legend: S = the step's constrained sample rows, W = ceil(V / 32) words per row.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence


class MaskRequest(NamedTuple):
    """One matcher's rows: ``row`` (the first, in the bitmask) gets the mask of its current
    state, ``row + 1 + i`` the mask after also consuming ``drafts[: i + 1]``."""

    matcher: Any
    row: int
    drafts: Sequence[int] = ()


def fill_bitmasks(
    executor: Any, requests: Sequence[MaskRequest], rows: int, width: int
) -> Any:
    """A numpy int32 ``[S = rows, W = width]``: bit ``t % 32`` of word ``t // 32`` set where token
    t is allowed, for every row ``requests`` name (llguidance's ``LLExecutor``, its threads
    in parallel, the GIL released). A matcher's draft rows past a draft token its grammar
    rejects keep every bit set: the rejected token ends acceptance before them."""
    # Here, not at import: numpy and llguidance come with the grammar extra.
    import llguidance.numpy as llnp
    import numpy as np

    bitmask = np.full((rows, width), -1, dtype=np.int32)
    if any(r.drafts for r in requests):
        llnp.fill_next_token_bitmask_par_with_draft_tokens(
            executor, [(r.matcher, r.row, list(r.drafts)) for r in requests], bitmask
        )
    else:
        llnp.fill_next_token_bitmask_par(executor, [(r.matcher, r.row) for r in requests], bitmask)
    return bitmask
