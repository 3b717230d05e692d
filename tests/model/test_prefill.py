"""`Prefill.launch`: a chunk started on the device without waiting, finished by `step`; and
`Prefill.run`, which keeps two chunks in flight: the same logits and prompt logprobs as
stepping, bit for bit, and a failed chunk poisons the cache."""

from __future__ import annotations

import numpy as np
import pytest

from model.cache import CachePoisoned

IDS = [2, *range(260, 360)]  # 101 ids of the tiny Gemma 3's text tokens


def stepped(prefill):
    while not prefill.done:
        prefill.step()
    return prefill.logits()


def test_launched_chunks_give_the_same_logits_as_stepped_ones(tiny):
    stepped_logits = stepped(tiny.start_prefill(IDS, chunk_tokens=16))
    prefill = tiny.start_prefill(IDS, chunk_tokens=16)
    sizes = []
    while not prefill.done:
        prefill.launch()
        prefill.launch()  # a second launch before the step is a no-op
        assert prefill.launched and prefill.cursor == 16 * len(sizes)  # committed at the step
        sizes.append(prefill.step())
    assert sizes == [16] * 6 + [5]
    assert prefill.chunks_done == 7
    np.testing.assert_array_equal(prefill.logits(), stepped_logits)  # the same graph
    prefill.launch()  # done: nothing to launch
    assert prefill.chunks_done == 7


def test_a_chunk_that_cannot_launch_raises_at_its_step(tiny):
    prefill = tiny.start_prefill(IDS, chunk_tokens=16)
    prefill.step()
    prefill.cache.poison()
    prefill.launch()  # does not raise here, where nothing would handle it
    with pytest.raises(CachePoisoned):
        prefill.step()
    assert prefill.cursor == 16 and prefill.chunks_done == 1
    prefill.reset()
    np.testing.assert_array_equal(prefill.run(), tiny.start_prefill(IDS, chunk_tokens=16).run())


@pytest.mark.parametrize("chunk", [7, 16, 101])
def test_run_with_two_chunks_in_flight_equals_stepping(tiny, chunk):
    ref = tiny.start_prefill(IDS, chunk_tokens=chunk, prompt_logprobs=3)
    ref_logits = stepped(ref)
    prefill = tiny.start_prefill(IDS, chunk_tokens=chunk, prompt_logprobs=3)
    np.testing.assert_array_equal(prefill.run(), ref_logits)
    assert prefill.chunks_done == ref.chunks_done == -(-len(IDS) // chunk)
    assert prefill.cursor == len(IDS) and prefill.compute_seconds > 0
    np.testing.assert_array_equal(prefill.logprobs.token_logprob, ref.logprobs.token_logprob)
    np.testing.assert_array_equal(prefill.logprobs.top_ids, ref.logprobs.top_ids)


def test_run_finishes_a_launched_chunk_first(tiny):
    prefill = tiny.start_prefill(IDS, chunk_tokens=16)
    prefill.launch()
    np.testing.assert_array_equal(prefill.run(), stepped(tiny.start_prefill(IDS, chunk_tokens=16)))
    assert prefill.chunks_done == 7


def test_run_on_deepseek4_equals_stepping():
    import mlx.core as mx

    from model.archs import deepseek4 as ds
    from model.gguf.reader import read_gguf
    from model.gguf.synthetic import tiny_deepseek4_path
    from model.start import start_prefill

    model = ds.load(read_gguf(tiny_deepseek4_path()[0]), mx.float32)
    ids = [int(t) for t in np.random.default_rng(4).integers(0, model.args.vocab_size, 300)]

    def start():
        return start_prefill(model, ids, vocab_size=model.args.vocab_size,
                             context_length=model.args.context_length, chunk_tokens=64)

    np.testing.assert_array_equal(start().run(), stepped(start()))


class FailsAtCall:
    """The tiny model, raising from its `n`-th forward pass (a chunk that fails)."""

    def __init__(self, model, n: int):
        self.model, self.n, self.calls = model, n, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("chunk failed")
        return self.model(*args, **kwargs)


def test_a_chunk_failing_mid_run_poisons_the_cache(tiny):
    from model.start import start_prefill

    model = FailsAtCall(tiny.model, 3)
    prefill = start_prefill(model, IDS, vocab_size=tiny.vocab_size,
                            context_length=tiny.context_length, chunk_tokens=16)
    with pytest.raises(RuntimeError, match="chunk failed"):
        prefill.run()
    # the 3rd chunk failed to build while the 2nd ran: only the 1st ever committed
    assert prefill.cursor == 16 and prefill.chunks_done == 1
    with pytest.raises(CachePoisoned):
        prefill.step()
    prefill.reset()
    model.n = 0  # no more failures
    np.testing.assert_array_equal(prefill.run(), stepped(tiny.start_prefill(IDS, chunk_tokens=16)))


def test_a_chunk_built_ahead_sees_the_position_after_the_launched_one(tiny):
    cache = tiny.model.make_cache(capacity=64)
    cache.commit(10)
    with cache.ahead(16):
        assert cache.position == 26
    assert cache.position == 10
    with pytest.raises(KeyError), cache.ahead(5):
        raise KeyError("restored on the way out too")
    assert cache.position == 10


def test_a_poisoned_prefill_gives_no_logits(tiny):
    # run()'s last cache writes evaluate after the last commit: if they failed, the cache is
    # poisoned at cursor n, and its logits must not be served
    prefill = tiny.start_prefill(IDS, chunk_tokens=16)
    prefill.run()
    prefill.cache.poison()
    assert prefill.done
    with pytest.raises(CachePoisoned):
        prefill.logits()
