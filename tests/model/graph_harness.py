"""`model.archs._gemma3_graph.GraphForward` run on the CPU with MLX's ops in place of the CUDA
kernels (the fused attention, the GELU gate, the Q/K heads), and the logits of jobs prefilled
through it alone or in packed steps, for the tests that check it against the module forward."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from model.archs import _gemma3_graph
from model.cache import window_mask
from model.kernels.gelu import gelu_gate

# float32 on the CPU, x max |logit|: compiled vs module forward measure 5.3e-7 to 1.0e-6
# on the tiny model and 0.0 on Gemma 3 270M; packed steps of the compiled graphs against
# each job alone, 3.7e-7 to 8.0e-7 (tiny) and 7.2e-7 to 2.8e-6 (270M: the matmuls over
# several jobs' rows block their sums otherwise). The equations are the same; the stacked
# q/k/v and gate/up matmuls sum in another blocking. A wrong weight, offset, position or
# job boundary moves logits by O(1) of their scale.
GRAPH_BOUND = 5e-6


def mlx_attend(q, keys, values, scale, position, window, mask):
    """`GraphForward`'s ``attend`` from MLX's attention (on CUDA, the fused kernel)."""
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)


def mlx_attend_packed(q, keys, values, scale, jobs, window):
    """`GraphForward`'s ``attend_packed`` from MLX's attention, job by job: each job's rows
    against its own keys, the first at ``position - (keys - rows)`` (on CUDA,
    `model.kernels.flash_attention.packed_flash_attention`)."""
    outs, q_row, k_row = [], 0, 0
    for rows, n_keys, position in jobs:
        q_rows, k_rows = slice(q_row, q_row + rows), slice(k_row, k_row + n_keys)
        outs.append(mx.fast.scaled_dot_product_attention(
            q[:, :, q_rows], keys[:, :, k_rows], values[:, :, k_rows], scale=scale,
            mask=window_mask(position, rows, position - (n_keys - rows), n_keys, window)))
        q_row, k_row = q_row + rows, k_row + n_keys
    assert (q_row, k_row) == (q.shape[2], keys.shape[2]), "jobs do not cover the rows"
    return mx.concatenate(outs, axis=2)


def mlx_gate(gate_up):
    """`GraphForward`'s ``gate`` from MLX's ops (on CUDA, `model.kernels.gelu`'s kernel)."""
    return gelu_gate(*mx.split(gate_up, 2, axis=-1))


def mlx_heads(qkv, positions, q_norm, k_norm, *, heads, kv_heads, base, scale, eps):
    """`GraphForward`'s ``heads`` from MLX's ops (on CUDA, `model.kernels.qk_norm_rope`)."""
    head_dim = qkv.shape[-1] // (heads + 2 * kv_heads)
    return _gemma3_graph._heads_packed(qkv[None], positions, q_norm, k_norm, eps=eps,
                                       heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                       base=base, scale=scale)


def logits_alone(model, ids, chunk, forward=None, cache=None) -> np.ndarray:
    """`ids` prefilled alone in `chunk`-token chunks through `forward` (default the module
    forward) into `cache` (default a new float32 one): the final logits, float32
    ``(vocab,)``."""
    cache = model.make_cache(mx.float32, capacity=len(ids)) if cache is None else cache
    for start in range(0, len(ids), chunk):
        inputs = mx.array(ids[start : start + chunk], dtype=mx.int32)[None]
        hidden = forward(model, inputs, cache) if forward else model(inputs, cache)
        mx.eval(hidden, cache.arrays())
        cache.commit(inputs.shape[1])
    return np.array(model.logits(hidden)[0])


def packed_logits(model, forward, jobs, chunk, joins=None) -> list[np.ndarray]:
    """Each job's final logits, its chunks run packed with the other jobs' through
    `forward.packed`, one step a chunk of every job with chunks left; job i of `joins`
    (job -> step) runs its first chunk at that step."""
    joins = joins or {}
    caches = [model.make_cache(mx.float32, capacity=len(ids)) for ids in jobs]
    hidden, done = [None] * len(jobs), [0] * len(jobs)
    step = 0
    while any(d < len(ids) for d, ids in zip(done, jobs, strict=True)):
        live = [i for i, ids in enumerate(jobs) if done[i] < len(ids) and joins.get(i, 0) <= step]
        inputs = [mx.array(jobs[i][done[i] : done[i] + chunk], dtype=mx.int32) for i in live]
        outs = forward.packed(model, inputs, [caches[i] for i in live])
        mx.eval(outs, *(caches[i].arrays() for i in live))
        for i, x, out in zip(live, inputs, outs, strict=True):
            caches[i].commit(x.shape[0])
            done[i] += x.shape[0]
            hidden[i] = out
        step += 1
    return [np.array(model.logits(h)[0]) for h in hidden]


def assert_scores_as_alone(model, forward, jobs, chunk, packed, joins=None):
    """Each of `jobs` prefilled through `forward` in `chunk`-token chunks, alone or in
    packed steps with the others (`joins` as `packed_logits`'s), gets the module forward's
    logits (`GRAPH_BOUND` of max |logit|, the same top-1)."""
    if packed:
        outs = packed_logits(model, forward, jobs, chunk, joins)
    else:
        outs = [logits_alone(model, ids, chunk, forward) for ids in jobs]
    for ids, out in zip(jobs, outs, strict=True):
        ref = logits_alone(model, ids, chunk)
        assert float(np.abs(out - ref).max()) <= GRAPH_BOUND * float(np.abs(ref).max())
        assert int(out.argmax()) == int(ref.argmax())
