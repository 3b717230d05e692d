"""`model.archs._gemma3_graph.GraphForward` (the compiled per-layer graphs a CUDA GPU runs) on
the CPU with MLX's attention in place of the fused kernel: the same logits as the module
forward, chunk by chunk across sliding-window wraps, on the tiny and the real Gemma 3."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from model.archs import gemma3
from model.archs._gemma3_graph import GraphForward

# float32 on the CPU, x max |logit|: compiled vs module forward measure 5.3e-7 to 1.0e-6
# on the tiny model and 0.0 on Gemma 3 270M. The equations are the same; the stacked q/k/v
# and gate/up matmuls sum in another blocking. The bound is ~5x the worst measured; a wrong
# weight, offset or norm moves logits by O(1) of their scale.
GRAPH_BOUND = 5e-6


def _mlx_attend(q, keys, values, scale, position, window, mask):
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)


def _logits(model, ids, chunk, forward=None) -> np.ndarray:
    cache = model.make_cache(mx.float32, capacity=len(ids))
    for start in range(0, len(ids), chunk):
        inputs = mx.array(ids[start : start + chunk], dtype=mx.int32)[None]
        hidden = forward(model, inputs, cache) if forward else model(inputs, cache)
        mx.eval(hidden, cache.arrays())
        cache.commit(inputs.shape[1])
    return np.array(model.logits(hidden)[0])


@pytest.mark.parametrize("chunk", [5, 16, 37])  # inside, at and past the 16-token window
def test_the_compiled_graphs_equal_the_module_forward_on_the_tiny_model(tiny, chunk):
    model = tiny.model
    ids = [int(t) for t in np.random.default_rng(chunk).integers(3, tiny.vocab_size, 90)]
    ref = _logits(model, ids, chunk)
    out = _logits(model, ids, chunk, GraphForward(_mlx_attend))
    assert float(np.abs(out - ref).max()) <= GRAPH_BOUND * float(np.abs(ref).max())
    assert int(out.argmax()) == int(ref.argmax())


def test_the_compiled_graphs_equal_the_module_forward_on_gemma3_270m(gemma):
    ids = [2, *[int(t) for t in np.random.default_rng(1).integers(3, 100_000, 699)]]
    ref = _logits(gemma.model, ids, 300)
    out = _logits(gemma.model, ids, 300, GraphForward(_mlx_attend))
    assert float(np.abs(out - ref).max()) <= GRAPH_BOUND * float(np.abs(ref).max())
    assert int(out.argmax()) == int(ref.argmax())


def test_the_cpu_runs_the_module_forward(tiny):
    cache = tiny.model.make_cache(mx.float32, capacity=8)
    assert not gemma3.graph_applies(tiny.model, cache)
