"""A request's answer assembled from what its choices produce: the whole response's choice
bodies, or each stream chunk's (what a choice added since its last chunk), an echoed prompt
first where asked for."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Union

from .engine import PromptRows
from .protocol import CompletionRequest
from .responses import ChoiceBody, LogprobRow, TokenTexts, chat_logprobs, completion_logprobs
from .text_stream import Piece
from .tools import ToolCalls


@dataclass
class Prompt:
    """One prompt of a request, tokenized: its ids, the text an echo shows, the text state its
    answer starts in."""

    ids: list[int]
    echo: str
    initial_state: str = "normal"


class Answer:
    """What a request's choices have produced so far, turned into choice bodies: the whole
    response's, or a stream chunk's (what was added since the last). ``tool_parser``: the
    tokenizer's, for the calls of a chat's answers (``tools.py``)."""

    def __init__(self, texts: TokenTexts, request: CompletionRequest, prompts: list[Prompt],
                 tool_parser=None):
        self.request, self.prompts, self.texts = request, prompts, texts
        count = len(prompts) * request.n
        self.text, self.reasoning = [""] * count, [""] * count
        # Each choice's tool-call texts not yet sent, and whether it made any call.
        self.calls: list[list[str]] = [[] for _ in range(count)]
        self.made_call = [False] * count
        self.formatters = [ToolCalls(tool_parser, request.tools.tools, request.stream)
                           for _ in range(count)]
        self.rows: list[list[LogprobRow]] = [[] for _ in range(count)]
        # Where each row's token's text starts in its choice's text (legacy text_offset).
        self.starts: list[list[int]] = [[] for _ in range(count)]
        self.finish: list[Optional[str]] = [None] * count
        # A choice's text before what it has not sent: its echo comes first.
        self.offset = [len(prompts[i // request.n].echo) if request.echo else 0
                       for i in range(count)]
        self.prompt_rows = [[LogprobRow(p.ids[0], None, None)] for p in prompts]
        self.echoed = [not request.echo] * count

    def add(self, item: Union[Piece, PromptRows]) -> None:
        if isinstance(item, PromptRows):
            self.prompt_rows[item.first // self.request.n] += item.rows
            return
        i = item.index
        if item.logprob is not None:
            self.rows[i].append(item.logprob)
            self.starts[i].append(self.offset[i] + len(self.text[i]))
        self.text[i] += item.text
        self.reasoning[i] += item.reasoning
        self.calls[i] += item.calls
        self.made_call[i] = self.made_call[i] or bool(item.calls)
        self.finish[i] = item.finish_reason or self.finish[i]

    def echo(self, i: int) -> Optional[ChoiceBody]:
        """Choice ``i``'s echoed prompt, the first time it is asked for (with ``echo``)."""
        if self.echoed[i]:
            return None
        self.echoed[i] = True
        prompt = self.prompts[i // self.request.n]
        logprobs = None
        if self.request.logprobs is not None:
            # A prompt token's text is its own decode: the offsets add those up.
            rows = self.prompt_rows[i // self.request.n]
            lengths = [len(self.texts(row.token)) for row in rows]
            starts = list(itertools.accumulate(lengths[:-1], initial=0))
            logprobs = completion_logprobs(rows, self.texts, starts)
        return ChoiceBody(i, prompt.echo, logprobs=logprobs)

    def ready(self, i: int) -> bool:
        """Whether choice ``i`` has produced anything a stream chunk sends now."""
        held = self.request.tools.forced
        return bool((self.text[i] and not held) or self.reasoning[i] or self.calls[i])

    def take(self, i: int, finish: bool = False) -> ChoiceBody:
        """Choice ``i``'s body from what it has produced since the last ``take``: a
        constrained call's text (``tool_choice`` required or named) is held back until it
        finishes, and then is its calls."""
        chat, tools = self.request.kind == "chat", self.request.tools
        logprobs = None
        if self.request.logprobs is not None:
            logprobs = (chat_logprobs(self.rows[i], self.texts) if chat
                        else completion_logprobs(self.rows[i], self.texts, self.starts[i]))
        held = tools.forced and not finish
        text = "" if held else self.text[i]
        calls = self.formatters[i].parse(self.calls[i])
        reason = self.finish[i] if finish else None
        if reason == "stop" and self.made_call[i]:
            reason = "tool_calls"
        if reason == "stop" and tools.forced:
            forced = self.formatters[i].forced(tools, text)
            if forced is not None:
                # vLLM's finish reasons: "tool_calls" for required, "stop" for a named one.
                text, calls = "", forced
                reason = "tool_calls" if tools.mode == "required" else "stop"
        body = ChoiceBody(i, text, reason, self.reasoning[i], logprobs, calls)
        self.offset[i] += len(text)
        if not held:
            self.text[i] = ""
        self.reasoning[i], self.calls[i] = "", []
        self.rows[i], self.starts[i] = [], []
        return body

    def whole(self, i: int) -> ChoiceBody:
        """Choice ``i`` whole: its echo first, if any."""
        echo = self.echo(i)
        body = self.take(i, finish=True)
        if echo is None:
            return body
        body.text = echo.text + body.text
        if echo.logprobs is not None:
            body.logprobs = {k: echo.logprobs[k] + body.logprobs[k] for k in body.logprobs}
        return body
