"""One request's tokens turned into text, as mlx_lm.server turns them.

mlx-lm's own parts do the work: a streaming detokenizer (``tokenizer.detokenizer``), the stop
sequences (end-of-sequence tokens and the request's stop strings, ``make_stop_sequences``) and
the text state machine that holds back what may be a stop string or a control sequence and
strips it (``make_text_state_machine``). ``TextStream.feed`` is mlx_lm.server's handling of one
generated token, from its generation loop and its ``handle_completion``, in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence


@dataclass
class Piece:
    """What one token adds to a response: ``text`` (answer), ``reasoning`` (between thinking
    markers), ``state`` (the text state after it: ``"tool"`` holds a stream's chunk back),
    ``finish_reason`` (``"stop"``, ``"length"`` or ``None`` while it runs) and ``calls``: the
    tool-call texts it completed (each between a pair of tool-call markers). The decoding
    thread sets which choice it belongs to (``index``) and the token's ``logprob`` row if asked
    for."""

    text: str
    reasoning: str
    state: Optional[str]
    finish_reason: Optional[str]
    calls: list[str] = field(default_factory=list)
    index: int = 0
    logprob: Optional[Any] = None


class TextStream:
    """The text of one request's tokens.

    Args:
        tokenizer: mlx-lm's ``TokenizerWrapper`` of the model.
        stop_words: the request's stop strings.
        max_tokens: the most tokens it generates ("length" at the last one).
        initial_state: the state machine's state at the start (``"normal"``, or ``"reasoning"``
            when the prompt opened a thinking block).
        tool_calls: whether the text between tool-call markers is a call (mlx_lm.server's
            rule); ``False``: it is answer text (no tools were offered).
    """

    def __init__(
        self,
        tokenizer: Any,
        stop_words: Sequence[str],
        max_tokens: int,
        initial_state: str = "normal",
        tool_calls: bool = True,
    ):
        from mlx_lm.generate import make_stop_sequences, make_text_state_machine

        self.detokenizer = tokenizer.detokenizer
        self.matcher = make_stop_sequences(tokenizer, list(stop_words)).matcher()
        self.state = make_text_state_machine(tokenizer, list(stop_words)).make_state(
            initial_state
        )
        self.max_tokens = max_tokens
        self.tokens = 0
        self.tool_calls = tool_calls
        self.previous = initial_state
        self.tool_text = ""

    def feed(self, token: int) -> Piece:
        """The next generated token -> what it adds; ``finish_reason`` is set on the last one
        ("stop": it completed a stop sequence, and its own text is dropped)."""
        from mlx_lm.generate import TextStateMachine

        self.tokens += 1
        finish = "length" if self.tokens >= self.max_tokens else None
        if self.matcher.advance(token):
            finish = "stop"
        if finish == "stop":
            return self._stop()
        self.detokenizer.add_token(token)
        if finish == "length":
            self.detokenizer.finalize()
        self.state, segments = TextStateMachine.split(self.state, self.detokenizer.last_segment)
        if finish == "length":
            self.state, flushed, current = TextStateMachine.flush(self.state)
            segments.append((current, flushed))
        return self._piece(segments, finish)

    def end_of_sequence(self) -> Piece:
        """The request ended at an end-of-sequence token, which the engine does not emit: it
        counts and ends the text as ``feed`` would have."""
        self.tokens += 1
        return self._stop()

    def _stop(self) -> Piece:
        """The last piece at a stop token: its text is never shown, and what the state machine
        holds back goes."""
        from mlx_lm.generate import TextStateMachine

        self.detokenizer.finalize()
        self.state, current = TextStateMachine.discard(self.state)
        return self._piece([(current, "")], "stop")

    def _piece(self, segments: list, finish: Optional[str]) -> Piece:
        """The segments sorted by state as mlx_lm.server sorts them: answer text in
        ``"normal"``, reasoning, and tool text, a call once its state is left (or the answer
        ends in it)."""
        piece = Piece("", "", segments[-1][0], finish)
        for state, text in segments:
            if state == "tool" and not self.tool_calls:
                state = "normal"
            if state == "reasoning":
                piece.reasoning += text
            elif state == "tool":
                self.tool_text += text
            elif state == "normal":
                if self.previous == "tool":
                    piece.calls.append(self.tool_text)
                    self.tool_text = ""
                piece.text += text
            self.previous = state
        if finish is not None and self.previous == "tool" and self.tool_text:
            piece.calls.append(self.tool_text)
        return piece
