"""`Prefill.launch`: a chunk started on the device without waiting, finished by `step`."""

from __future__ import annotations

import numpy as np
import pytest

from model.cache import CachePoisoned

IDS = [2, *range(260, 360)]  # 101 ids of the tiny Gemma 3's text tokens


def test_launched_chunks_give_the_same_logits_as_stepped_ones(tiny):
    stepped = tiny.start_prefill(IDS, chunk_tokens=16).run()
    prefill = tiny.start_prefill(IDS, chunk_tokens=16)
    sizes = []
    while not prefill.done:
        prefill.launch()
        prefill.launch()  # a second launch before the step is a no-op
        assert prefill.launched and prefill.cursor == 16 * len(sizes)  # committed at the step
        sizes.append(prefill.step())
    assert sizes == [16] * 6 + [5]
    assert prefill.chunks_done == 7
    np.testing.assert_array_equal(prefill.logits(), stepped)  # the same graph, bit for bit
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
