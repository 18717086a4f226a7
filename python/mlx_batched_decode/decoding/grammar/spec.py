"""``GrammarSpec``: what a request's output must match, as plain strings (it travels to
tensor-parallel followers inside the plan)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# "json_object": any JSON object (OpenAI's response_format {"type": "json_object"}).
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
_ANY_OBJECT = '{"type": "object"}'


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on a request's output text.

    Attributes:
        kind: one of ``GRAMMAR_KINDS``.
        source: the JSON schema's JSON text ("json_schema"), the regex ("regex"), the Lark
            grammar ("lark"), a JSON list of strings ("choice"); ignored for "json_object".

    Hashable: the compiler's cache is keyed by it.
    """

    kind: str
    source: str = ""

    def __post_init__(self):
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise ValueError(f"grammar source must be a string, got {type(self.source).__name__}")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "source": self.source}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GrammarSpec":
        return cls(data["kind"], data.get("source", ""))

    def llguidance_grammar(self) -> str:
        """llguidance's grammar text for it; ``ValueError`` where the source cannot be
        read (JSON that does not parse, say: compiling finds the rest)."""
        import llguidance

        if self.kind == "json_object":
            return llguidance.grammar_from("json_schema", _ANY_OBJECT)
        return llguidance.grammar_from(self.kind, self.source)
