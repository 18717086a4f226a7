"""A random-weight mlx-lm model folder with a small word-level tokenizer, made offline.

``save_model_folder`` writes what ``mlx_lm.load`` and ``mlx_lm.server --model DIR`` read:

- ``model.safetensors`` (+ index) and ``config.json``, written with mlx-lm's own ``save_model``
  and ``save_config`` from a model built by ``random_model``;
- ``tokenizer.json``: a ``tokenizers`` word-level tokenizer, made here without any download;
  ids 0-4 are ``<unk>``, ``<|end|>`` (end of sequence) and the chat roles ``<|system|>``,
  ``<|user|>``, ``<|assistant|>``; the other ids are the words ``w5``, ``w6``, ... (so any
  text of such words, separated by spaces, round-trips through it);
- ``tokenizer_config.json``: the tokenizer class, the special tokens and a chat template
  (``<|role|> content`` per message, then ``<|assistant|>``).
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


def word(token_id: int) -> str:
    """The text of a word token (``token_id >= len(SPECIAL_TOKENS)``)."""
    return f"w{token_id}"


def save_model_folder(config: dict[str, Any], path: Union[str, Path], seed: int = 0) -> Path:
    """Write a random-weight model of ``config`` (float32) and its tokenizer to ``path``.

    The tokenizer has ``config["vocab_size"]`` tokens. Returns ``path``.
    """
    import tokenizers
    from mlx_lm.utils import save_config, save_model

    path = Path(path)
    vocab_size = config["vocab_size"]
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(
            f"[save_model_folder] vocab_size must exceed the {len(SPECIAL_TOKENS)} special "
            f"tokens, got {vocab_size}"
        )
    save_model(path, random_model(config, seed=seed))
    save_config({**config, "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN)}, path / "config.json")

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({word(i): i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "eos_token": EOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 1 << 20,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return path
