"""One rank of the tensor-parallel test, started by ``mlx.launch`` as
``python -m tests.support.tp_worker DIR`` from the repository root (see
tests/integrations/test_tensor_parallel.py).

Every rank builds the same random-weight models, shards them over ``mx.distributed.init()``'s
group with mlx-lm's ``model.shard``, decodes the same prompts with ``BatchedDecoder`` and with
``batch_generate`` under the mlx-lm plug-in, and writes ``rank<r>.json`` into the folder given as
its argument: the tokens, and the head counts the op and the slot caches saw on this rank. The
models and prompts are defined here and imported by the test, which decodes them unsharded.
"""

import json
import pathlib
import sys

import mlx.core as mx
from mlx_lm.generate import batch_generate, generation_stream

import mlx_batched_decode
import mlx_batched_decode.mlx_lm as plugin
from mlx_batched_decode.decoding.decoder import BatchedDecoder
from mlx_batched_decode.tools.random_model import random_model
from mlx_batched_decode.integrations.tensor_parallel import shard
from tests.support.mlx_lm_models import GPT_OSS, LLAMA_GQA4, random_prompts

# Head counts divisible by 2 ranks; gpt-oss adds sinks, a sliding-window layer and experts.
FAMILIES = {
    "llama": LLAMA_GQA4,
    "gpt_oss": GPT_OSS,
}
PROMPT_LENS = [1, 9, 40, 17, 3]
MAX_TOKENS = [12, 4, 12, 20, 1]


def build(family):
    """The unsharded random-weight model of ``family``, the same in every process."""
    model = random_model(FAMILIES[family], seed=1)
    if family == "gpt_oss":
        for layer in model.layers:
            layer.self_attn.sinks = 2.0 * mx.random.normal(layer.self_attn.sinks.shape)
        mx.eval(model.parameters())
    return model


def prompts():
    return random_prompts(PROMPT_LENS)


class Tokenizer:
    """What ``batch_generate`` uses of a tokenizer: no end tokens."""

    eos_token_ids = ()

    def decode(self, tokens):
        return ""


def main(out_dir):
    group = mx.distributed.init()
    seen_heads = []
    real_op = mlx_batched_decode.batched_decode_attention

    def op_spy(queries, keys, values, valid_lens, **kwargs):
        seen_heads.append((queries.shape[1], keys.shape[1]))
        return real_op(queries, keys, values, valid_lens, **kwargs)

    mlx_batched_decode.batched_decode_attention = op_spy
    result = {"rank": group.rank(), "size": group.size()}
    for family in FAMILIES:
        model = shard(build(family), group)
        seen_heads.clear()
        decoder = BatchedDecoder(model)
        tokens = decoder.generate(prompts(), MAX_TOKENS, max_batch_size=3)
        with plugin.enabled():
            plugin_tokens = batch_generate(
                model, Tokenizer(), prompts(), max_tokens=MAX_TOKENS, return_token_ids=True
            ).token_ids
            # mlx-lm returns with a step still running on its stream: let it finish before
            # the next model's collectives.
            mx.synchronize(generation_stream)
            served = plugin.stats().served
        result[family] = {
            "tokens": tokens,
            "plugin_tokens": plugin_tokens,
            "plugin_served": served,
            "op_heads": sorted(set(seen_heads)),
            "cache_heads": decoder.slot_caches[0].keys.shape[1],
        }
    pathlib.Path(out_dir, f"rank{group.rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
