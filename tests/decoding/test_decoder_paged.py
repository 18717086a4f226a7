"""BatchedDecoder(kv_layout="paged"): greedy tokens equal mlx-lm's single-request decode, with and
without prefix sharing, for prompts that share 0, 1, several blocks and a partial block with
earlier ones, with requests joining and leaving mid-way and waiting for the block budget."""

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")

import mlx_batched_decode  # noqa: E402
from mlx_batched_decode import _ext  # noqa: E402
from mlx_batched_decode.decoding.decoder import BatchedDecoder  # noqa: E402
from mlx_batched_decode.caches.paged_kv_cache import POOL_LAYOUTS  # noqa: E402
from mlx_batched_decode.caches.prefix_hashes import block_hashes  # noqa: E402
from mlx_batched_decode.tools.random_model import random_model  # noqa: E402
from tests.support.mlx_lm_models import GPT_OSS, LLAMA, QWEN3, mlx_lm_greedy, random_prompts  # noqa: E402

BASE, OWN = random_prompts([70, 40], seed=5)
# Against block size 16, in arrival order: no earlier prompt; the first 40 tokens of the first
# (2 full blocks shared, a partial third not); 1 block; several (3) blocks of the second; a
# different prompt; the first prompt again; a one-token prompt; 1 block again.
PROMPTS = [
    BASE[:45],
    BASE[:40] + OWN[:9],
    BASE[:16] + OWN[:3],
    BASE[:52] + OWN[9:20],
    OWN[:30],
    BASE[:45],
    OWN[:1],
    BASE[:17],
]
MAX_TOKENS = [9, 3, 12, 6, 10, 4, 7, 5]


@pytest.fixture(scope="module")
def models():
    return {
        "llama": random_model(LLAMA, seed=1),
        "qwen3": random_model(QWEN3, seed=2),
        "gpt_oss": random_model(GPT_OSS, seed=3),
    }


@pytest.fixture(scope="module")
def references(models):
    return {
        name: [mlx_lm_greedy(model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
        for name, model in models.items()
    }


def expected_hits(prompts, block_size):
    """Prompt tokens whose blocks an earlier prompt left cached (all stay cached here)."""
    seen, hits = set(), 0
    for prompt in prompts:
        hashes = block_hashes(prompt[:-1], block_size)
        shared = 0
        while shared < len(hashes) and hashes[shared] in seen:
            shared += 1
        hits += shared * block_size
        seen.update(hashes)
    return hits


class OpSpy:
    """Counts calls of the paged op (and of the dense one, which must not run)."""

    def __init__(self, monkeypatch):
        self.paged = self.dense = 0
        self.tables = []
        real = mlx_batched_decode.paged_decode_attention

        def paged(queries, key_pages, value_pages, block_tables, valid_lens, **kwargs):
            self.paged += 1
            self.tables.append((block_tables, valid_lens))
            return real(queries, key_pages, value_pages, block_tables, valid_lens, **kwargs)

        def dense(*args, **kwargs):
            self.dense += 1
            raise AssertionError("the dense op ran on the paged layout")

        monkeypatch.setattr(mlx_batched_decode, "paged_decode_attention", paged)
        monkeypatch.setattr(mlx_batched_decode, "batched_decode_attention", dense)


@pytest.mark.parametrize("pool_layout", POOL_LAYOUTS)
@pytest.mark.parametrize("block_size", [16, 7])
@pytest.mark.parametrize("sharing", [True, False])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_matches_mlx_lm_with_shared_prefixes(
    models, references, family, sharing, block_size, pool_layout, monkeypatch
):
    spy = OpSpy(monkeypatch)
    decoder = BatchedDecoder(
        models[family],
        kv_layout="paged",
        block_size=block_size,
        pool_layout=pool_layout,
        prefix_sharing=sharing,
    )
    kernel_calls = _ext.cpu_kernel_calls()
    # At most 3 at once: requests join as others leave; budgets differ, so they leave mid-way.
    out = decoder.generate(PROMPTS, MAX_TOKENS, max_batch_size=3)
    assert out == references[family]
    layers = len(decoder.paged_cache.keys)
    assert spy.paged == decoder.stats.steps * layers and spy.dense == 0
    if mx.default_device() == mx.cpu:
        # The fused CPU kernel ran once per layer and step, not a fallback.
        assert _ext.cpu_kernel_calls() - kernel_calls == spy.paged
    # One step's layers all read the same block tables and lengths, built once per step.
    for step in range(decoder.stats.steps):
        arrays = spy.tables[step * layers : (step + 1) * layers]
        assert all(t is arrays[0][0] and v is arrays[0][1] for t, v in arrays)
    assert len({id(t) for t, _ in spy.tables}) == decoder.stats.steps
    hits = expected_hits(PROMPTS, block_size) if sharing else 0
    assert decoder.stats.prefix_hit_tokens == hits
    assert decoder.stats.prompt_tokens == sum(len(p) for p in PROMPTS)
    if sharing:
        assert hits >= 4 * block_size
    assert decoder.num_active == 0 and decoder.stats.blocks_in_use == 0
    assert decoder.paged_cache.allocator.reserved == 0


@pytest.mark.parametrize("sharing", [True, False])
def test_long_shared_prefix_is_read_once_per_step(models, sharing):
    """Prompts sharing 1040 tokens: with sharing, the CPU kernel reads the shared blocks once
    for all requests of a step (its cells are 512 keys); tokens stay mlx-lm's."""
    model = models["llama"]
    prefix, own = random_prompts([1040, 30], seed=9)
    prompts = [prefix + own[i : i + 5] for i in range(0, 15, 5)]
    expected = [mlx_lm_greedy(model, p, 4) for p in prompts]
    decoder = BatchedDecoder(model, kv_layout="paged", prefix_sharing=sharing)
    shared_items = _ext.cpu_shared_items()
    assert decoder.generate(prompts, 4) == expected
    assert decoder.stats.prefix_hit_tokens == (2 * 1040 if sharing else 0)
    if mx.default_device() == mx.cpu:
        assert (_ext.cpu_shared_items() > shared_items) == sharing


def test_requests_join_and_leave_mid_decode_sharing_running_blocks(models, references):
    """Requests join while those whose blocks they share are still decoding."""
    decoder = BatchedDecoder(models["llama"], kv_layout="paged", block_size=8)
    produced, uids = {}, {}
    joins = {0: [0, 4], 2: [1, 3], 3: [5, 2], 6: [6, 7]}
    in_use = []
    for step in range(40):
        for i in joins.get(step, []):
            uids[decoder.add_request(PROMPTS[i], MAX_TOKENS[i])] = i
        if decoder.num_active == 0:
            break
        result = decoder.step()
        in_use.append(decoder.stats.blocks_in_use)
        for uid, tokens in result.tokens.items():
            produced.setdefault(uids[uid], []).extend(tokens)
    assert [produced[i] for i in range(len(PROMPTS))] == references["llama"]
    assert decoder.stats.prefix_hit_tokens > 0 and max(in_use) > 0 and in_use[-1] == 0


def test_requests_wait_for_the_block_budget(models, references):
    decoder = BatchedDecoder(
        models["qwen3"], kv_layout="paged", block_size=8, max_kv_blocks=14, max_cached_blocks=4
    )
    waiting = []
    step = decoder.step

    def watching_step(*args, **kwargs):
        waiting.append(decoder.num_waiting)
        result = step(*args, **kwargs)
        assert decoder.stats.blocks_in_use <= 14
        return result

    decoder.step = watching_step
    assert decoder.generate(PROMPTS, MAX_TOKENS) == references["qwen3"]
    assert max(waiting) > 0
    assert decoder.paged_cache.num_blocks == 14 and decoder.stats.blocks_in_use == 0


@pytest.mark.parametrize("sharing", [True, False])
def test_sliding_window_and_sinks(models, references, sharing):
    """Windowed layers share prefix blocks too: the steps write every position of every
    layer, so a cached block holds a whole prefix whatever the layer's window (16 here)."""
    decoder = BatchedDecoder(
        models["gpt_oss"], kv_layout="paged", block_size=8, prefix_sharing=sharing
    )
    assert decoder.generate(PROMPTS, MAX_TOKENS, max_batch_size=4) == references["gpt_oss"]
    assert decoder.stats.prefix_hit_tokens == (expected_hits(PROMPTS, 8) if sharing else 0)


def test_bad_arguments_and_unsupported_combinations(models):
    model = models["llama"]
    cases = [
        (dict(kv_layout="pages"), "kv_layout must be 'slot' or 'paged'"),
        (dict(kv_layout="paged", attention="seed"), "needs attention='slot'"),
        (dict(kv_layout="paged", draft_model=model), "does not decode speculatively"),
        (dict(kv_layout="paged", block_size=0), "block_size must be >= 1"),
        (dict(kv_layout="paged", pool_layout="rows"), "pool_layout must be one of"),
        (dict(kv_layout="paged", max_kv_blocks=0), "max_kv_blocks must be >= 1"),
        (dict(kv_layout="paged", max_cached_blocks=-1), "max_cached_blocks must be >= 0"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=rf"^\[BatchedDecoder\] .*{message}"):
            BatchedDecoder(model, **kwargs)
    decoder = BatchedDecoder(model, kv_layout="paged", block_size=4, max_kv_blocks=3)
    with pytest.raises(ValueError, match=r"^\[BatchedDecoder\] .* needs 4 blocks, more than"):
        decoder.add_request(list(range(10)), 4)
    assert decoder.num_active == decoder.num_waiting == 0
    assert decoder.slot_caches is None and BatchedDecoder(model).paged_cache is None


def test_memory_returns_after_requests_leave(models):
    """Once every request has left and the prefix cache is cleared, only the pools remain."""
    decoder = BatchedDecoder(models["llama"], kv_layout="paged", block_size=8)
    decoder.generate(PROMPTS, MAX_TOKENS)
    cache = decoder.paged_cache
    mx.eval(cache.keys, cache.values)
    mx.clear_cache()
    baseline = mx.get_active_memory()
    decoder.generate(PROMPTS, MAX_TOKENS, max_batch_size=2)
    assert cache.blocks_in_use == 0
    cache.clear_prefix_cache()
    assert cache.allocator.num_free == cache.num_blocks
    mx.clear_cache()
    assert mx.get_active_memory() == baseline


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cached_prefix_prefill_equals_a_whole_prefill(models, family):
    """Every request's keys/values in the pools, shared blocks and its own prefill continuing
    from them, equal a prefill of its whole prompt through mlx-lm's own caches."""
    from tests.support.mlx_lm_prefill import prefill

    model = models[family]
    decoder = BatchedDecoder(model, kv_layout="paged", block_size=8)
    uids = [decoder.add_request(p, 100) for p in PROMPTS]
    # Until every prompt is in: a request waits for the blocks an earlier prompt is writing.
    while any(decoder.stats.requests[u].first_token is None for u in uids):
        decoder.step()
    assert decoder.stats.prefix_hit_tokens == expected_hits(PROMPTS, 8) > 0
    for uid, prompt in zip(uids, PROMPTS):
        if len(prompt) == 1:
            continue
        paged = decoder.paged_cache.prefix_keys_values(uid, len(prompt) - 1)
        whole = prefill(model, prompt[:-1], 2048)
        for (pk, pv), (wk, wv) in zip(paged, whole):
            assert mx.allclose(pk, wk, atol=1e-4, rtol=1e-4).item()
            assert mx.allclose(pv, wv, atol=1e-4, rtol=1e-4).item()
