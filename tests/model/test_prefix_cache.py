"""`model.prefix_cache`: block keys that name one prefix of one model's cache in every
process, and blocks of KV rows that any later prompt sharing the prefix restores, with the
same logits as a cold prefill of that prompt, on the tiny Gemma 3 (16-token window) and a
tiny Llama-family model (global attention only)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from jobs.prefixes import BLOCK_TOKENS, block_keys, root_key, salted
from model.cache import RowLog
from model.planner import plan_chunks
from model.prefill import Prefill
from model.prefix_cache import PrefixCache, prefix_prefill, token_bytes
from model.registry import load_model

# float32 on the CPU, max |diff| / max |logit| of a prefill from restored blocks against a
# cold one of the same prompt: measured 0 to 1.1e-6 on the tiny models and 6.6e-7 to 9.5e-7
# on Gemma 3 270M (the rows are the same numbers; the chunks after the prefix cut the
# matmuls elsewhere). ~5x the worst. Prompt logprobs x the largest |logprob| compared:
# measured 0 to 2.6e-7 (tiny) and 8e-8 to 1.3e-6 (270M, prefixes of 96 and 576 tokens).
REUSE_BOUND = 5e-6


@pytest.fixture(scope="module")
def qwen3_tiny():
    return load_model("qwen3-tiny")


def _ids(rng, n: int, vocab: int) -> list[int]:
    return [2, *(int(t) for t in rng.integers(3, vocab, n - 1))]


def _root(loaded) -> bytes:
    return root_key(loaded.sha256, loaded.model.make_cache(mx.float32).layout())


def _cold(loaded, ids: list[int], chunk: int, keep_rows: bool = False) -> Prefill:
    p = loaded.start_prefill(ids, chunk_tokens=chunk)
    if keep_rows:
        p.cache.keep_rows()
    p.run()
    return p


def _from_prefix(loaded, cache: PrefixCache, ids: list[int], chunk: int) -> tuple[int, np.ndarray]:
    """A prefill of `ids` from the longest prefix `cache` holds (at least one token left to
    run): the tokens reused and the final logits."""
    keys = block_keys(ids, _root(loaded), cache.block_tokens)
    m = min(cache.longest(keys), (len(ids) - 1) // cache.block_tokens)
    kv = loaded.model.make_cache(mx.float32, capacity=len(ids))
    n = cache.restore(keys[:m], kv)
    plan = plan_chunks(len(ids), loaded.sliding_window, chunk_tokens=chunk, cursor=n)
    p = Prefill(loaded.model, ids, plan, kv, cached_tokens=n, reuse="prefix")
    return n, p.run()


def _close(out: np.ndarray, ref: np.ndarray) -> None:
    assert float(np.abs(out - ref).max()) <= REUSE_BOUND * float(np.abs(ref).max())
    assert int(out.argmax()) == int(ref.argmax())


# --- reuse --------------------------------------------------------------------------------


@pytest.mark.parametrize("block, shared, chunk", [
    (8, 9, 37),     # one block: the prefix ends inside the first 16-token window
    (8, 30, 37),    # 24 tokens: past the window, not on a window edge
    (8, 60, 37),    # 56 tokens: inside the first prompt's second chunk (37-74)
    (BLOCK_TOKENS, 70, 16),  # two default blocks, chunks of one window
])
def test_a_shared_prefix_restored_from_blocks_prefills_like_a_cold_prompt(tiny, block, shared,
                                                                          chunk):
    rng = np.random.default_rng(block + shared)
    first = _ids(rng, 100, tiny.vocab_size)
    second = first[:shared] + _ids(rng, 41, tiny.vocab_size)[1:]
    cache = PrefixCache(max_bytes=1 << 30, block_tokens=block)
    cache.insert(block_keys(first, _root(tiny), block), _cold(tiny, first, chunk, True).cache)
    n, out = _from_prefix(tiny, cache, second, chunk)
    assert n == shared // block * block > 0
    _close(out, _cold(tiny, second, chunk).logits())


def test_gemma3_270m_reuses_prefixes_inside_and_past_its_512_token_window(gemma):
    rng = np.random.default_rng(9)
    first = _ids(rng, 700, 100_000)
    cache = PrefixCache(1 << 32, BLOCK_TOKENS)
    cache.insert(block_keys(first, _root(gemma), BLOCK_TOKENS),
                 _cold(gemma, first, 300, True).cache)
    for shared in (350, 600):  # 320 and 576 tokens reused: inside, then past the window
        second = first[:shared] + _ids(rng, 100, 100_000)[1:]
        n, out = _from_prefix(gemma, cache, second, 300)
        assert n == shared // BLOCK_TOKENS * BLOCK_TOKENS
        _close(out, _cold(gemma, second, 300).logits())


def test_a_prompt_held_whole_still_runs_its_last_token(tiny):
    ids = _ids(np.random.default_rng(3), 64, tiny.vocab_size)
    cache = PrefixCache(max_bytes=1 << 30, block_tokens=16)
    cache.insert(block_keys(ids, _root(tiny), 16), _cold(tiny, ids, 64, True).cache)
    n, out = _from_prefix(tiny, cache, ids, 64)
    assert n == 48  # 64 held, 48 reused: the last block's tokens run for the logits
    _close(out, _cold(tiny, ids, 64).logits())


def test_a_global_attention_model_reuses_without_kept_rows(qwen3_tiny):
    rng = np.random.default_rng(4)
    first = _ids(rng, 90, qwen3_tiny.vocab_size)
    second = first[:50] + _ids(rng, 30, qwen3_tiny.vocab_size)[1:]
    cache = PrefixCache(max_bytes=1 << 30, block_tokens=16)
    cache.insert(block_keys(first, _root(qwen3_tiny), 16), _cold(qwen3_tiny, first, 32).cache)
    n, out = _from_prefix(qwen3_tiny, cache, second, 32)
    assert n == 48
    _close(out, _cold(qwen3_tiny, second, 32).logits())


def test_a_sliding_layer_must_have_kept_its_rows(tiny):
    ids = _ids(np.random.default_rng(5), 40, tiny.vocab_size)
    cache = PrefixCache(max_bytes=1 << 30, block_tokens=8)
    with pytest.raises(ValueError, match="keep_rows"):
        cache.insert(block_keys(ids, _root(tiny), 8), _cold(tiny, ids, 40).cache)
    assert len(cache) == 0 and cache.nbytes == 0


def test_blocks_restore_only_into_an_empty_cache(tiny):
    ids = _ids(np.random.default_rng(6), 40, tiny.vocab_size)
    keys = block_keys(ids, _root(tiny), 8)
    cache = PrefixCache(max_bytes=1 << 30, block_tokens=8)
    used = _cold(tiny, ids, 40, True).cache
    cache.insert(keys, used)
    with pytest.raises(ValueError, match="empty cache"):
        cache.restore(keys[:2], used)
    with pytest.raises(KeyError):
        cache.restore([b"\0" * 16], tiny.model.make_cache(mx.float32))


def test_eviction_takes_a_prefixs_last_blocks_first_within_the_bytes(tiny):
    ids = _ids(np.random.default_rng(7), 48, tiny.vocab_size)
    keys = block_keys(ids, _root(tiny), 16)
    kv = _cold(tiny, ids, 48, True).cache
    one = PrefixCache(max_bytes=1 << 30, block_tokens=16)
    one.insert(keys[:1], kv)
    cache = PrefixCache(max_bytes=2 * one.nbytes, block_tokens=16)
    assert cache.insert(keys, kv) == 3
    assert len(cache) == 2 and cache.nbytes == 2 * one.nbytes
    assert cache.longest(keys) == 2  # the third block went, the prefix's root stayed
    other = _ids(np.random.default_rng(8), 16, tiny.vocab_size)
    cache.insert(block_keys(other, _root(tiny), 16), _cold(tiny, other, 16, True).cache)
    assert cache.longest(keys) == 1 and cache.nbytes <= cache.max_bytes


def test_a_row_log_keeps_the_last_write_of_each_position():
    log = RowLog(axis=0)
    log.write(0, mx.arange(10))
    log.write(10, mx.arange(10, 20))
    log.write(15, mx.arange(100, 110))  # a chunk run again from 15: 15-19 superseded
    assert log.rows(0, 25)[0].tolist() == [*range(15), *range(100, 110)]
    assert log.rows(12, 17)[0].tolist() == [12, 13, 14, 100, 101]
    with pytest.raises(ValueError, match="not all written"):
        log.rows(20, 30)


def _prefix_prefill(loaded, ids, prefixes, salt=None, **kwargs):
    root = salted(root_key(loaded.sha256, loaded.model.make_cache(mx.float32).layout()), salt)
    return prefix_prefill(loaded.model, ids, prefixes, block_keys(ids, root, BLOCK_TOKENS),
                          vocab_size=loaded.vocab_size, context_length=loaded.context_length,
                          **kwargs)


def test_a_prefill_starts_from_the_longest_held_prefix_and_equals_a_cold_one(tiny):
    rng = np.random.default_rng(11)
    context = _ids(rng, 100, tiny.vocab_size)  # 3 whole blocks of 32
    prefixes = PrefixCache(1 << 30, BLOCK_TOKENS)
    first, keys = _prefix_prefill(tiny, context + [5, 6, 7], prefixes, chunk_tokens=48)
    assert (first.reuse, first.cached_tokens, len(keys)) == ("cold", 0, 3)
    first.run()
    assert prefixes.insert(keys, first.cache) == 3
    prompt = context[:70] + [int(t) for t in rng.integers(3, tiny.vocab_size, 50)]
    second, keys = _prefix_prefill(tiny, prompt, prefixes, chunk_tokens=48)
    assert (second.reuse, second.cached_tokens, second.cursor) == ("prefix", 64, 64)
    assert second.plan.start == 64 and len(keys) == 3  # its third block is new: captured
    got, ref = second.run(), tiny.start_prefill(prompt, chunk_tokens=48).run()
    assert float(np.abs(got - ref).max()) <= REUSE_BOUND * float(np.abs(ref).max())
    assert int(got.argmax()) == int(ref.argmax())


def _held(loaded, ids) -> tuple[PrefixCache, Prefill]:
    """A prefix cache holding the blocks of `ids`, kept by a finished prefill (returned)."""
    prefixes = PrefixCache(1 << 30, BLOCK_TOKENS)
    first, keys = _prefix_prefill(loaded, ids, prefixes)
    first.run()
    prefixes.insert(keys, first.cache)
    return prefixes, first


def test_a_prompt_held_whole_runs_its_last_block_and_captures_nothing(tiny):
    ids = _ids(np.random.default_rng(12), 64, tiny.vocab_size)
    prefixes, _ = _held(tiny, ids)
    again, keys = _prefix_prefill(tiny, ids, prefixes)
    assert (again.cached_tokens, again.n_tokens - again.cursor, keys) == (32, 32, [])
    assert not again.keep_cache  # nothing to insert: its last chunk need not write its rows
    got, ref = again.run(), tiny.start_prefill(ids).run()
    assert float(np.abs(got - ref).max()) <= REUSE_BOUND * float(np.abs(ref).max())


def test_blocks_without_logprobs_salts_or_a_small_budget_share_nothing(tiny):
    ids = _ids(np.random.default_rng(13), 80, tiny.vocab_size)
    prefixes, first = _held(tiny, ids)
    logprobs, keys = _prefix_prefill(tiny, ids, prefixes, prompt_logprobs=2)
    assert (logprobs.reuse, logprobs.cached_tokens, len(keys)) == ("cold", 0, 2)
    logprobs.run()  # its blocks, held without logprobs, get them
    assert prefixes.insert(keys, logprobs.cache, logprobs.logprobs) == 2
    assert _prefix_prefill(tiny, ids, prefixes, prompt_logprobs=2)[0].cached_tokens == 64
    assert _prefix_prefill(tiny, ids, prefixes, prompt_logprobs=3)[0].cached_tokens == 0
    salted, _ = _prefix_prefill(tiny, ids, prefixes, salt="tenant-b")
    assert salted.cached_tokens == 0
    one_block = PrefixCache(token_bytes(first.cache) * BLOCK_TOKENS, BLOCK_TOKENS)
    too_big, keys = _prefix_prefill(tiny, ids, one_block)  # 2 blocks over a 1-block budget
    assert keys == [] and too_big.cache.layers[0].log is None



def _assert_logprobs_survive(loaded, context, cut, chunk, rng, high):
    prefixes = PrefixCache(1 << 32, BLOCK_TOKENS)
    first, keys = _prefix_prefill(loaded, context + [300, 301], prefixes, chunk_tokens=chunk,
                                  prompt_logprobs=3)
    first.run()
    assert prefixes.insert(keys, first.cache, first.logprobs) == len(keys)
    prompt = context[:cut] + [int(t) for t in rng.integers(3, high, 30)]
    warm, _ = _prefix_prefill(loaded, prompt, prefixes, chunk_tokens=chunk, prompt_logprobs=2)
    assert (warm.reuse, warm.cached_tokens, warm.logprobs.filled) == ("prefix", cut, cut)
    got = warm.run()
    cold = loaded.start_prefill(prompt, chunk_tokens=chunk, prompt_logprobs=2)
    ref = cold.run()
    assert float(np.abs(got - ref).max()) <= REUSE_BOUND * float(np.abs(ref).max())
    # the kept entries are the capturing prefill's, the entry after each block comes from
    # its kept hidden state
    a, b = warm.logprobs, cold.logprobs
    scale = max(float(np.nanmax(np.abs(b.token_logprob))), float(np.abs(b.top_logprobs).max()))
    np.testing.assert_array_equal(np.isnan(a.token_logprob), np.isnan(b.token_logprob))
    assert float(np.nanmax(np.abs(a.token_logprob - b.token_logprob))) <= REUSE_BOUND * scale
    assert float(np.abs(a.top_logprobs - b.top_logprobs).max()) <= REUSE_BOUND * scale
    np.testing.assert_array_equal(a.top_ids, b.top_ids)


@pytest.mark.parametrize("chunk", [16, 48])  # inside and past the 16-token window, mid-block
def test_prompt_logprobs_survive_reuse_as_a_cold_prefill_gives_them(tiny, chunk):
    rng = np.random.default_rng(14)
    _assert_logprobs_survive(tiny, _ids(rng, 100, tiny.vocab_size), 96, chunk, rng,
                             tiny.vocab_size)


def test_prompt_logprobs_survive_reuse_on_gemma3_270m_past_its_window(gemma):
    rng = np.random.default_rng(15)
    _assert_logprobs_survive(gemma, _ids(rng, 600, 100_000), 576, 256, rng, 100_000)


def test_after_eviction_a_prompt_reuses_what_is_left_as_a_cold_prefill_would(tiny):
    rng = np.random.default_rng(16)
    context = _ids(rng, 130, tiny.vocab_size)  # 4 whole blocks, past the 16-token window
    first, keys = _prefix_prefill(tiny, context, PrefixCache(1 << 30, BLOCK_TOKENS),
                                  prompt_logprobs=2)
    first.run()
    per_block = token_bytes(first.cache) * BLOCK_TOKENS
    prefixes = PrefixCache(int(2.5 * per_block), BLOCK_TOKENS)  # room for 2 blocks (and K)
    prefixes.insert(keys, first.cache, first.logprobs)
    assert prefixes.longest(keys) == 2  # the last two evicted, the prefix's start kept
    other = _ids(rng, 40, tiny.vocab_size)  # 1 more block: the first prompt's tail goes
    held = _prefix_prefill(tiny, other, PrefixCache(1 << 30, BLOCK_TOKENS))
    held[0].run()
    prefixes.insert(held[1], held[0].cache)
    assert prefixes.longest(keys) == 1  # the other prompt's blocks took one more
    prompt = context[:120] + [int(t) for t in rng.integers(3, tiny.vocab_size, 20)]
    warm, _ = _prefix_prefill(tiny, prompt, prefixes, prompt_logprobs=2)
    assert warm.cached_tokens == prefixes.longest(keys) * BLOCK_TOKENS
    got = warm.run()
    cold = tiny.start_prefill(prompt, prompt_logprobs=2)
    ref = cold.run()
    assert float(np.abs(got - ref).max()) <= REUSE_BOUND * float(np.abs(ref).max())
    assert int(got.argmax()) == int(ref.argmax())
    a, b = warm.logprobs, cold.logprobs
    scale = float(np.nanmax(np.abs(b.token_logprob)))
    assert float(np.nanmax(np.abs(a.token_logprob - b.token_logprob))) <= REUSE_BOUND * scale
    np.testing.assert_array_equal(a.top_ids, b.top_ids)


@pytest.mark.slow
def test_smollm2_reuses_prefixes_and_their_prompt_logprobs():
    from model.registry import load_model

    smollm2 = load_model("smollm2-135m")  # global attention only, grouped queries
    rng = np.random.default_rng(17)
    _assert_logprobs_survive(smollm2, _ids(rng, 300, 40_000), 288, 128, rng, 40_000)
