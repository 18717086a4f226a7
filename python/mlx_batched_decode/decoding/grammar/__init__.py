"""Grammar-constrained decoding (structured output) with llguidance, inside the batched step.

``GrammarSpec`` names a constraint (a JSON schema, any JSON object, a regex, a choice of
strings, a Lark grammar); ``GrammarCompiler`` validates and caches compiled grammars for one
tokenizer and makes each request's matcher; ``GrammarMatcher`` is a request's state (tokens
consumed, whether the constraint is active yet: ``after``); ``fill_bitmasks`` writes the
step's token bitmasks of every constrained row at once, which ``sample_rows`` applies.

llguidance is an optional dependency (the ``grammar`` extra): importing this package without
it works, making a ``GrammarCompiler`` does not.
"""

from .compiler import GrammarCompiler
from .masks import MaskRequest, fill_bitmasks
from .matcher import GrammarMatcher
from .spec import GRAMMAR_KINDS, GrammarSpec

__all__ = [
    "GRAMMAR_KINDS",
    "GrammarCompiler",
    "GrammarMatcher",
    "GrammarSpec",
    "MaskRequest",
    "fill_bitmasks",
]
