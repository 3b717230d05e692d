"""A chunk in flight (begun, not committed): `abandon` takes every cache back to its last
commit exactly, and nothing leaves a cache while a chunk is in flight (`model.cache`).

Both caches (`ModelCache` of the tiny Gemma 3, `Deepseek4Cache` of the tiny DeepSeek-V4)
are driven through `Prefill.launch`, as the worker drives them; each chunk rewrites rings
(and DeepSeek-V4's compressor state) that a later chunk reads.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from model.cache import CachePoisoned, ChunkInFlight
from model.session import session_prefill
from model.start import start_prefill

IDS = [2, *range(260, 360)]  # 101 ids of the tiny Gemma 3's text tokens


@pytest.fixture(scope="module")
def deepseek4():
    from model.archs import deepseek4 as ds
    from model.gguf.reader import read_gguf
    from model.gguf.synthetic import tiny_deepseek4_path

    return ds.load(read_gguf(tiny_deepseek4_path()[0]), mx.float32)


@pytest.fixture(params=["gemma3-tiny", "deepseek4-tiny"])
def start(request, tiny):
    """``start(chunk_tokens)``: a cold prefill of a 101- or 300-token prompt."""
    if request.param == "gemma3-tiny":
        return lambda chunk: tiny.start_prefill(IDS, chunk_tokens=chunk)
    model = request.getfixturevalue("deepseek4")
    ids = [int(t) for t in np.random.default_rng(4).integers(0, model.args.vocab_size, 300)]
    return lambda chunk: start_prefill(model, ids, vocab_size=model.args.vocab_size,
                                       context_length=model.args.context_length,
                                       chunk_tokens=chunk)


def stepped(prefill) -> np.ndarray:
    while not prefill.done:
        prefill.step()
    return prefill.logits()


def test_abandon_returns_the_cache_to_its_last_commit_exactly(start):
    prefill = start(32)
    prefill.step()
    committed = prefill.cache.state()
    prefill.launch()
    assert prefill.cache.in_flight == 32
    mx.eval(prefill.cache.arrays())  # the launched chunk's writes have landed
    prefill.abandon()
    assert not prefill.launched and prefill.cache.in_flight == 0 and prefill.cursor == 32
    after = prefill.cache.state()
    assert after.meta == committed.meta and after.blobs == committed.blobs
    np.testing.assert_array_equal(stepped(prefill), stepped(start(32)))


def test_nothing_leaves_a_cache_with_a_chunk_in_flight(start):
    prefill = start(32)
    prefill.step()
    prefill.launch()
    with pytest.raises(ChunkInFlight):
        prefill.cache.state()
    with pytest.raises(ChunkInFlight):
        prefill.cache.snapshot()
    prefill.step()  # committed: settled again
    assert prefill.cache.in_flight == 0
    prefill.cache.state()


def test_two_chunks_in_flight_land_in_order_and_give_the_logits_of_one_at_a_time(start):
    """`launch(ahead=True)` builds the next chunk behind the one in flight, as the worker
    does; the last chunk's pass computes the final logits. Both as stepping alone."""
    prefill, alone = start(32), stepped(start(32))
    prefill.launch()
    prefill.launch(ahead=True)
    prefill.launch(ahead=True)  # two in flight at most
    assert prefill.cache.in_flight == 64
    while prefill.launched:
        prefill.step()
        prefill.launch(ahead=True)
        prefill.launch(ahead=True)
    assert prefill.done and prefill._logits is not None  # from the last chunk's pass
    np.testing.assert_array_equal(prefill.logits(), alone)


def test_abandon_with_two_chunks_in_flight_returns_to_the_last_commit(start):
    prefill = start(32)
    prefill.step()
    committed = prefill.cache.state()
    prefill.launch()
    prefill.launch(ahead=True)
    assert prefill.cache.in_flight == 64
    prefill.abandon()
    assert (prefill.cache.in_flight, prefill.cursor) == (0, 32)
    assert prefill.cache.state().blobs == committed.blobs
    np.testing.assert_array_equal(stepped(prefill), stepped(start(32)))


def test_commits_follow_the_chunks_in_flight_in_order(tiny):
    cache = tiny.model.make_cache(capacity=64)
    cache.begin(16)
    with cache.ahead(16):
        cache.begin(8)
    assert cache.in_flight == 24
    with pytest.raises(ValueError, match="oldest chunk in flight has 16"):
        cache.commit(8)
    cache.commit(16)
    cache.commit(8)
    assert (cache.position, cache.in_flight) == (24, 0)


def test_an_abandoned_failed_chunk_stays_poisoned(tiny):
    prefill = tiny.start_prefill(IDS, chunk_tokens=16)
    prefill.step()
    prefill.launch()
    prefill.cache.poison()  # as a failed evaluation of the launched chunk leaves it
    prefill.abandon()
    assert prefill.cache.is_poisoned and prefill.cache.in_flight == 0
    with pytest.raises(CachePoisoned):
        prefill.step()


def test_growth_refuses_a_chunk_in_flight(tiny):
    prefill = tiny.start_prefill(IDS, chunk_tokens=16)
    prefill.step()
    prefill.launch()
    with pytest.raises(ChunkInFlight):
        prefill.cache.grow(prefill.cache.capacity + 256)


def test_a_slot_whose_cache_has_a_chunk_in_flight_offers_no_live_reuse(tiny):
    """Defence in depth: were a slot ever kept with a chunk in flight, the next turn would
    not reuse its live prefix (the rows past it are not what its tokens say)."""
    kwargs = dict(vocab_size=tiny.vocab_size, context_length=tiny.context_length,
                  chunk_tokens=16, kv_dtype=mx.float32)
    prompt = IDS + IDS[1:]  # 201 ids: 144 committed are past the seeds' 128 for reuse
    prefill, slot = session_prefill(tiny.model, None, prompt, **kwargs)
    while prefill.cursor < 144:
        prefill.step()
    prefill.launch()
    longer = prompt + list(range(300, 340))
    assert slot.choose(longer).kind == "reset"
    prefill.abandon()
    assert (slot.choose(longer).kind, slot.choose(longer).tokens) == ("live", 144)
