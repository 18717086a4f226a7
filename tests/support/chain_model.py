"""A model folder whose greedy answers are chosen texts: a bigram Llama over a word-level
tokenizer made of those texts' pieces, with a chat template that renders tools.

Each answer text is cut into pieces no other answer shares, one token each (the tokenizer's
``Fuse`` decoder joins tokens as they are, so a piece may hold spaces and markup). The model's
residual stream is the token's one-hot embedding (attention and MLP outputs zeroed) and its
head maps each token to its successor: the prompt's last word (a "trigger") picks the answer,
each piece is followed by the next and the last by the end of sequence. The chat template
renders tools, assistant tool calls and tool results (``<|tool|>``), and names
``<tool_call>`` and ``tool_call.name``: mlx-lm infers its ``json_tools`` parser.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Union

SPECIALS = ["<unk>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
HIDDEN = 192
# No generation prompt: the last word of the last message is the trigger.
TEMPLATE = (
    "{%- if tools %}<|system|> tools: {% for tool in tools %}{{ tool.function.name }} "
    "{% endfor %}{% endif -%}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|tool|> {{ message.tool_call_id }} {{ message.content }} "
    "{%- else %}<|{{ message.role }}|> {{ message.content }} {% endif %}"
    "{%- for call in message.tool_calls or [] %}{% set tool_call = call.function %}"
    "<tool_call> {{ tool_call.name }} {{ tool_call.arguments | tojson }} </tool_call> "
    "{% endfor %}{% endfor %}"
)


def _pieces(text: str, used: set[str], longest: int = 9) -> list[str]:
    """``text`` cut into pieces none of ``used`` holds (longest first), added to it."""
    pieces, start = [], 0
    while start < len(text):
        for size in range(min(longest, len(text) - start), 0, -1):
            piece = text[start:start + size]
            if piece not in used and not piece.isspace():
                break
        else:
            raise ValueError(f"no unused piece of {text!r} at {start}")
        used.add(piece)
        pieces.append(piece)
        start += size
    return pieces


def save_chain_model_folder(answers: dict[str, str], path: Union[str, Path]) -> Path:
    """Write the model folder whose greedy answer to a prompt ending in the word ``w`` is
    ``answers[w]`` (then the end of sequence). Returns ``path``."""
    import mlx.core as mx
    import tokenizers
    from mlx_lm.utils import save_config, save_model

    from mlx_batched_decode.tools.random_model import random_model

    path = Path(path)
    used = set(SPECIALS) | set(answers)
    vocab = {token: i for i, token in enumerate([*SPECIALS, *answers])}
    successor = {}
    for trigger, text in answers.items():
        chain = [vocab[trigger]]
        for piece in _pieces(text, used):
            vocab[piece] = len(vocab)
            chain.append(vocab[piece])
        successor.update(zip(chain, chain[1:]))
    if len(vocab) > HIDDEN:
        raise ValueError(f"{len(vocab)} tokens exceed the hidden size {HIDDEN}")
    config = dict(model_type="llama", hidden_size=HIDDEN, num_hidden_layers=1,
                  intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
                  head_dim=32, rms_norm_eps=1e-6, vocab_size=len(vocab),
                  tie_word_embeddings=False)
    model = random_model(config)
    end = SPECIALS.index("<|end|>")
    head = [[0.0] * HIDDEN for _ in vocab]
    for token in range(len(vocab)):
        head[successor.get(token, end)][token] = 10.0
    layer = model.model.layers[0]
    model.model.embed_tokens.weight = mx.eye(len(vocab), HIDDEN)
    layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
    layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    model.lm_head.weight = mx.array(head)
    save_model(path, model)
    save_config({**config, "eos_token_id": end}, path / "config.json")

    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = tokenizers.decoders.Fuse()
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "eos_token": "<|end|>",
        "chat_template": TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
    }))
    return path
