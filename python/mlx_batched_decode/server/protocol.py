"""The OpenAI-style wire format's shared records: the error every refusal is, the server's
defaults, and a request once checked.

Requests are checked field by field before any work (``fields.parse_request``); anything wrong
is an ``APIError`` whose body is OpenAI's ``{"error": {"message", "type", "code"}}``. Response
bodies are built in ``responses.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

# The name mlx_lm.server gives the model it was started with.
DEFAULT_MODEL = "default_model"


class APIError(Exception):
    """An error answered to the client: HTTP ``status`` with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "code": self.code}}


@dataclass
class Defaults:
    """The server's defaults for fields a request leaves out (its flags)."""

    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0


@dataclass(frozen=True)
class ToolChoice:
    """A chat request's checked ``tools`` and ``tool_choice`` (``tools.py`` reads them).

    ``tools``: what the chat template renders (``None``: no tools). ``mode``: ``"none"``,
    ``"auto"``, ``"required"`` or ``"function"`` (``name`` is that function)."""

    tools: Optional[list[dict]] = None
    mode: str = "auto"
    name: Optional[str] = None

    @property
    def parsed(self) -> bool:
        """Whether the model's own tool-call markup is parsed into calls."""
        return self.mode == "auto"

    @property
    def forced(self) -> bool:
        """Whether the answer is constrained to calls (a grammar builds them)."""
        return self.mode in ("required", "function")


@dataclass
class CompletionRequest:
    """One checked request: ``kind`` is ``"text"`` (``prompts``) or ``"chat"`` (``messages``).

    ``prompts``: a completion's prompts, each a string or token ids (one group of ``n``
    choices each). ``sampling``: the ``Sampler`` keywords it sets (every knob but ``seed``,
    already mapped into ``[0, 2**64)``, and ``logprobs``). ``logprobs``: how many alternatives
    each reported token comes with (``None``: no logprobs). ``echo``: a completion's prompt
    comes first in its text (and logprobs). ``tools``: a chat's tools and ``tool_choice`` (a
    completion offers none). ``constraint``: what the answer must match (``structured.py``;
    ``None``: anything)."""

    kind: str
    model: str
    prompts: list[Union[str, list[int]]] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    max_tokens: int = 512
    n: int = 1
    sampling: dict[str, Any] = field(default_factory=dict)
    seed: Optional[int] = None
    logprobs: Optional[int] = None
    echo: bool = False
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    chat_template_kwargs: dict = field(default_factory=dict)
    tools: ToolChoice = field(default_factory=lambda: ToolChoice(None, "none"))
    constraint: Optional[Any] = None
