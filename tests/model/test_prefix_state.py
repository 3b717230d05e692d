"""`model.prefix_state`: a prefix block as bytes and back, bit-exact (rows and prompt
logprobs), and refused when it is another version, another layer count or garbage."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from jobs.prefixes import BLOCK_TOKENS, block_keys, root_key
from jobs.serializer import packb, unpackb
from model.cache import CacheStateError
from model.prefix_cache import PrefixCache, prefix_prefill
from model.prefix_state import block_from_state, block_state


def _kept(loaded, k: int | None):
    ids = [2, *np.random.default_rng(3).integers(3, loaded.vocab_size, 70).tolist()]
    root = root_key(loaded.sha256, loaded.model.make_cache(mx.float32).layout())
    prefixes = PrefixCache(1 << 30, BLOCK_TOKENS)
    prefill, keys = prefix_prefill(loaded.model, ids, prefixes, block_keys(ids, root),
                                   vocab_size=loaded.vocab_size,
                                   context_length=loaded.context_length, prompt_logprobs=k)
    prefill.run()
    prefixes.insert(keys, prefill.cache, prefill.logprobs)
    return prefixes.get(keys[1]), len(prefill.cache.layers)


@pytest.mark.parametrize("k", [None, 3])
def test_a_block_survives_bytes_bit_exact(tiny, k):
    block, n_layers = _kept(tiny, k)
    back = block_from_state(unpackb(packb(block_state(block))), n_layers)
    assert back.nbytes == block.nbytes
    for (k0, v0), (k1, v1) in zip(block.rows, back.rows, strict=True):
        assert k1.dtype == k0.dtype and k1.shape == k0.shape
        assert np.array_equal(np.array(k0), np.array(k1))
        assert np.array_equal(np.array(v0), np.array(v1))
    if k is None:
        assert back.logprobs is None
        return
    a, b = block.logprobs, back.logprobs
    assert b.k == 3
    np.testing.assert_array_equal(a.token_logprob, b.token_logprob)
    np.testing.assert_array_equal(a.top_ids, b.top_ids)
    np.testing.assert_array_equal(a.top_logprobs, b.top_logprobs)
    assert np.array_equal(np.array(a.hidden), np.array(b.hidden))


def test_a_block_of_another_shape_or_garbage_is_refused(tiny):
    block, n_layers = _kept(tiny, None)
    state = block_state(block)
    with pytest.raises(CacheStateError, match="layers"):
        block_from_state(state, n_layers + 1)
    with pytest.raises(CacheStateError, match="version"):
        block_from_state({**state, "version": 99}, n_layers)
    with pytest.raises(CacheStateError, match="does not decode"):
        block_from_state({**state, "rows": [[["float32", [1, 2], b"xx"]] * 2] * n_layers},
                         n_layers)
    with pytest.raises(CacheStateError, match="dtype"):
        block_from_state({**state, "rows": [[["int8", [1], b"x"]] * 2] * n_layers}, n_layers)
