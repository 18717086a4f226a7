"""``GrammarMatcher``: one request's (one choice's) grammar state across its steps."""

from __future__ import annotations

from typing import Any, Optional, Sequence


class GrammarMatcher:
    """An ``llguidance.LLMatcher`` and when its constraint starts.

    Args:
        matcher: a fresh matcher (``GrammarCompiler.matcher``).
        after: a token id ending a section the constraint skips (a thinking section's
            ``</think>``): the generated tokens up to and including its first occurrence are
            unconstrained, the answer after it is constrained. ``None``: from the first token.
    """

    def __init__(self, matcher: Any, after: Optional[int] = None):
        self.matcher = matcher
        self.after = after
        self.active = after is None

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance over the tokens the request emitted, in order: those up to the trigger
        token only look for it; none past a stop (after an end of sequence, say)."""
        for token in tokens:
            if not self.active:
                self.active = token == self.after
                continue
            if self.matcher.is_stopped():
                return
            self.matcher.consume_token(token)

    def first_constrained(self, drafts: Sequence[int]) -> int:
        """Of the ``len(drafts) + 1`` rows that verify ``drafts`` (row j samples after the
        j-th), the first the constraint applies to: 0 when active, one past the trigger
        token's first position among ``drafts`` otherwise, ``len(drafts) + 1`` for none."""
        if self.active:
            return 0
        for j, token in enumerate(drafts):
            if token == self.after:
                return j + 1
        return len(drafts) + 1

    @property
    def stopped(self) -> bool:
        """Whether the constraint admits no further token but an end of sequence (it was
        completed and cannot grow, or an end of sequence was consumed)."""
        return self.active and self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """Whether the text so far satisfies the constraint (inactive: vacuously not)."""
        return self.active and self.matcher.is_accepting()

    @property
    def error(self) -> Optional[str]:
        """llguidance's message once it consumed a token its grammar forbids, else ``None``."""
        return self.matcher.get_error() if self.matcher.is_error() else None
