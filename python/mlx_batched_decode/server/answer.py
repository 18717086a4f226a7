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


@dataclass
class Prompt:
    """One prompt of a request, tokenized: its ids, the text an echo shows, the text state its
    answer starts in."""

    ids: list[int]
    echo: str
    initial_state: str = "normal"


class Answer:
    """What a request's choices have produced so far, turned into choice bodies: the whole
    response's, or a stream chunk's (what was added since the last)."""

    def __init__(self, texts: TokenTexts, request: CompletionRequest, prompts: list[Prompt]):
        self.request, self.prompts, self.texts = request, prompts, texts
        count = len(prompts) * request.n
        self.text, self.reasoning = [""] * count, [""] * count
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

    def take(self, i: int, finish: bool = False) -> ChoiceBody:
        """Choice ``i``'s body from what it has produced since the last ``take``."""
        chat = self.request.kind == "chat"
        logprobs = None
        if self.request.logprobs is not None:
            logprobs = (chat_logprobs(self.rows[i], self.texts) if chat
                        else completion_logprobs(self.rows[i], self.texts, self.starts[i]))
        body = ChoiceBody(i, self.text[i], self.finish[i] if finish else None,
                          self.reasoning[i], logprobs)
        self.offset[i] += len(self.text[i])
        self.text[i] = self.reasoning[i] = ""
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
