"""Random-weight mlx-lm model folders with small tokenizers, made offline.

``save_model_folder`` (a word-level tokenizer) writes what ``mlx_lm.load`` and
``mlx_lm.server --model DIR`` read:

- ``model.safetensors`` (+ index) and ``config.json``, written with mlx-lm's own ``save_model``
  and ``save_config`` from a model built by ``random_model``;
- ``tokenizer.json``: a ``tokenizers`` word-level tokenizer, made here without any download;
  ids 0-4 are ``<unk>``, ``<|end|>`` (end of sequence) and the chat roles ``<|system|>``,
  ``<|user|>``, ``<|assistant|>``; the other ids are the words ``w5``, ``w6``, ... (so any
  text of such words, separated by spaces, round-trips through it);
- ``tokenizer_config.json``: the tokenizer class, the special tokens and a chat template
  (``<|role|> content`` per message, then ``<|assistant|>``).

``save_byte_model_folder`` writes the same files with a byte-level tokenizer instead, over
which any text is reachable (what grammar-constrained decoding needs): ids 0-255 are the
bytes (GPT-2's byte-to-character map, a BPE with no merges), then ``BYTE_SPECIAL_TOKENS``:
``<|end|>`` (end of sequence), the chat roles, and ``<think>``/``</think>`` (a thinking
section's ends). The model's vocabulary may exceed the tokenizer's (padded logits).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

from .random_model import random_model

SPECIAL_TOKENS = ["<unk>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
EOS_TOKEN = "<|end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


BYTE_SPECIAL_TOKENS = [EOS_TOKEN, "<|system|>", "<|user|>", "<|assistant|>", "<think>", "</think>"]
# The byte tokenizer's size: 256 bytes, then its special tokens.
BYTE_VOCAB = 256 + len(BYTE_SPECIAL_TOKENS)
BYTE_EOS_ID = 256
BYTE_THINK_END_ID = 256 + BYTE_SPECIAL_TOKENS.index("</think>")


def word(token_id: int) -> str:
    """The text of a word token (``token_id >= len(SPECIAL_TOKENS)``)."""
    return f"w{token_id}"


def save_model_folder(config: dict[str, Any], path: Union[str, Path], seed: int = 0) -> Path:
    """Write a random-weight model of ``config`` (float32) and its tokenizer to ``path``.

    The tokenizer has ``config["vocab_size"]`` tokens. Returns ``path``.
    """
    import tokenizers

    vocab_size = config["vocab_size"]
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(
            f"[save_model_folder] vocab_size must exceed the {len(SPECIAL_TOKENS)} special "
            f"tokens, got {vocab_size}"
        )
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({word(i): i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    eos_id = SPECIAL_TOKENS.index(EOS_TOKEN)
    return _write_folder(Path(path), config, seed, eos_id, tokenizer, {"unk_token": "<unk>"})


def _write_folder(
    path: Path, config: dict[str, Any], seed: int, eos_id: int, tokenizer: Any, extra: dict
) -> Path:
    """A random-weight model of ``config`` and ``tokenizer`` (a ``tokenizers.Tokenizer``),
    written as mlx-lm writes a model folder: the weights, ``config.json`` with ``eos_id``,
    ``tokenizer.json`` and a ``tokenizer_config.json`` with ``extra`` keys."""
    from mlx_lm.utils import save_config, save_model

    save_model(path, random_model(config, seed=seed))
    save_config({**config, "eos_token_id": eos_id}, path / "config.json")
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **extra,
        "eos_token": EOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 1 << 20,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return path


def byte_tokenizer(special_tokens: list[str] = BYTE_SPECIAL_TOKENS) -> Any:
    """A ``tokenizers.Tokenizer`` of the 256 bytes (ids 0-255: byte ``i`` is id ``i``, as GPT-2's
    byte-level characters, no merges) and then ``special_tokens``."""
    import tokenizers
    from tokenizers import decoders, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {byte_char(b): b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(special_tokens)
    return tokenizer


def byte_char(b: int) -> str:
    """GPT-2's printable character for byte ``b`` (``bytes_to_unicode``)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if b in printable:
        return chr(b)
    return chr(256 + sum(1 for x in range(b) if x not in printable))


def save_byte_model_folder(config: dict[str, Any], path: Union[str, Path], seed: int = 0) -> Path:
    """Write a random-weight model of ``config`` (float32) with the byte-level tokenizer to
    ``path``; ``config["vocab_size"]`` is at least ``BYTE_VOCAB`` (more: padded logits, ids
    no text maps to). Returns ``path``."""
    if config["vocab_size"] < BYTE_VOCAB:
        raise ValueError(
            f"[save_byte_model_folder] vocab_size must be at least {BYTE_VOCAB}, "
            f"got {config['vocab_size']}"
        )
    return _write_folder(Path(path), config, seed, BYTE_EOS_ID, byte_tokenizer(), {})
