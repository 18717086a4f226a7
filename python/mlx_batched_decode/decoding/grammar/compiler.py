"""``GrammarCompiler``: one tokenizer's llguidance view and an LRU of compiled grammars."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Optional

from .spec import GrammarSpec


class GrammarCompiler:
    """Compiles ``GrammarSpec``s against one tokenizer and makes matchers from them.

    Args:
        tokenizer: a Hugging Face fast tokenizer, or mlx-lm's ``TokenizerWrapper`` (its
            ``_tokenizer``, and its ``eos_token_ids``: the ends of sequence the grammars
            allow once satisfied).
        vocab_size: V, the logits' width: ids past the tokenizer's (padding) are never allowed.
        cache_size: compiled grammars kept, least recently used dropped first.
        num_threads: the ``LLExecutor``'s threads that fill a step's masks (``None``:
            llguidance's default, 80% of the cores).

    Thread-safe: a server validates on its tokenizing thread (``check``) while the engine's
    thread makes matchers (``matcher``). Building the tokenizer's view takes about a second
    for a 128k vocabulary: make one compiler per tokenizer.
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, cache_size: int = 64,
        num_threads: Optional[int] = None,
    ):
        import llguidance

        self.vocab_size = vocab_size
        self.tokenizer = _ll_tokenizer(tokenizer, vocab_size)
        self.executor = llguidance.LLExecutor(num_threads)
        self.cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, spec: GrammarSpec) -> None:
        """``ValueError`` with llguidance's message unless ``spec`` compiles (then cached)."""
        self._template(spec)

    def matcher(self, spec: GrammarSpec) -> Any:
        """A fresh ``llguidance.LLMatcher`` of ``spec`` (a copy of its cached template: a
        copy costs microseconds, a new matcher re-reads the grammar); ``ValueError`` as
        ``check``."""
        return self._template(spec).deep_copy()

    def _template(self, spec: GrammarSpec) -> Any:
        with self._lock:
            template = self._cache.get(spec)
            if template is not None:
                self._cache.move_to_end(spec)
                return template
        # Compiled outside the lock (milliseconds to seconds): another thread's lookups go on.
        template = self._compile(spec)
        with self._lock:
            self._cache[spec] = template
            self._cache.move_to_end(spec)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return template

    def _compile(self, spec: GrammarSpec) -> Any:
        import llguidance

        try:
            grammar = spec.llguidance_grammar()
        except (ValueError, TypeError) as error:
            raise ValueError(f"invalid {spec.kind} grammar: {error}") from None
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(f"invalid {spec.kind} grammar: {template.get_error()}")
        return template


def _ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of a fast tokenizer (what ``llguidance.hf.from_tokenizer`` does,
    without its class check, which transformers 5's tokenizer classes fail)."""
    import copy

    import llguidance

    # mlx-lm's wrapper holds the HF tokenizer, which holds the Rust one (as _tokenizer too).
    hf = tokenizer if hasattr(tokenizer, "backend_tokenizer") else getattr(tokenizer, "_tokenizer", None)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("grammars need a fast (Rust tokenizers) tokenizer")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    eos = sorted(tokenizer.eos_token_ids) if hf is not tokenizer else hf.eos_token_id
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
