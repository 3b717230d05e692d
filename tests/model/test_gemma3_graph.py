"""`model.archs._gemma3_graph.GraphForward` (the compiled per-layer graphs a CUDA GPU runs) on
the CPU with MLX's attention in place of the fused kernel: the same logits as the module
forward, chunk by chunk across sliding-window wraps, on the tiny and the real Gemma 3, alone
and in packed steps of several jobs."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from model.archs import _gemma3_graph, gemma3
from model.archs._gemma3_graph import GraphForward, padded_rows
from model.cache import window_mask
from model.kernels.gelu import gelu_gate

# float32 on the CPU, x max |logit|: compiled vs module forward measure 5.3e-7 to 1.0e-6
# on the tiny model and 0.0 on Gemma 3 270M; packed steps of the compiled graphs against
# each job alone, 3.7e-7 to 8.0e-7 (tiny) and 7.2e-7 to 2.8e-6 (270M: the matmuls over
# several jobs' rows block their sums otherwise). The equations are the same; the stacked
# q/k/v and gate/up matmuls sum in another blocking. A wrong weight, offset, position or
# job boundary moves logits by O(1) of their scale.
GRAPH_BOUND = 5e-6


def _mlx_attend(q, keys, values, scale, position, window, mask):
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)


def _mlx_attend_fresh(q, k, v, scale, lengths, window):
    """`GraphForward`'s ``attend_fresh`` from MLX's attention, job by job."""
    outs, start = [], 0
    for n in lengths:
        rows = slice(start, start + n)
        outs.append(mx.fast.scaled_dot_product_attention(
            q[:, :, rows], k[:, :, rows], v[:, :, rows], scale=scale,
            mask=window_mask(0, n, 0, n, window)))
        start += n
    return mx.concatenate(outs, axis=2)


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


def _packed_logits(model, forward, jobs, chunk, joins=None) -> list[np.ndarray]:
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


def _assert_scores_as_alone(model, forward, jobs, chunk, packed):
    """Each of `jobs` prefilled through `forward` in `chunk`-token chunks, alone or in
    packed steps with the others, gets the module forward's logits (`GRAPH_BOUND`, top-1)."""
    if packed:
        outs = _packed_logits(model, forward, jobs, chunk)
    else:
        outs = [_logits(model, ids, chunk, forward) for ids in jobs]
    for ids, out in zip(jobs, outs, strict=True):
        ref = _logits(model, ids, chunk)
        assert float(np.abs(out - ref).max()) <= GRAPH_BOUND * float(np.abs(ref).max())
        assert int(out.argmax()) == int(ref.argmax())


def _mlx_gate(gate_up):
    """`GraphForward`'s ``gate`` from MLX's ops (on CUDA, `model.kernels.gelu`'s kernel)."""
    return gelu_gate(*mx.split(gate_up, 2, axis=-1))


@pytest.mark.parametrize("packed", [False, True], ids=["one-job", "packed"])
def test_the_gate_between_two_compiled_halves_scores_as_the_one_compiled_post(
        tiny, monkeypatch, packed):
    """A layer whose gated product reaches `GATE_KERNEL_MIN` values runs the ``gate``
    between `_attn_out` and `_mlp_out`; one below it, inside `_post`. Both give the module
    forward's logits."""
    calls = []

    def gate(gate_up):
        calls.append(gate_up.shape)
        return _mlx_gate(gate_up)

    model, rng = tiny.model, np.random.default_rng(4)
    jobs = [[int(t) for t in rng.integers(3, tiny.vocab_size, n)] for n in (40, 23)]
    width = 2 * model.args.intermediate_size
    monkeypatch.setattr(_gemma3_graph, "GATE_KERNEL_MIN", 24 * width // 2)  # 24 rows
    _assert_scores_as_alone(model, GraphForward(_mlx_attend, _mlx_attend_fresh, gate), jobs,
                            30, packed)
    assert {s[-1] for s in calls} == {width}
    # one job: its 30-row chunk through the gate, the 10- and 23-row ones inside `_post`;
    # packed: 30 + 23 rows padded to 64, then 10 padded to 32
    rows = {shape[-2] for shape in calls}
    assert rows == ({64, 32} if packed else {30})


def _mlx_heads(qkv, positions, q_norm, k_norm, *, heads, kv_heads, base, scale, eps):
    """`GraphForward`'s ``heads`` from MLX's ops (on CUDA, `model.kernels.qk_norm_rope`)."""
    head_dim = qkv.shape[-1] // (heads + 2 * kv_heads)
    return _gemma3_graph._heads_packed(qkv[None], positions, q_norm, k_norm, eps=eps,
                                       heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                       base=base, scale=scale)


@pytest.mark.parametrize("packed", [False, True], ids=["one-job", "packed"])
def test_the_heads_after_the_compiled_projection_score_as_the_one_compiled_pre(
        gemma, monkeypatch, packed):
    """A chunk whose q/k/v projection reaches `HEADS_KERNEL_MIN` values splits, norms and
    rotates its heads in the ``heads`` step (a kernel on CUDA) after the compiled `_qkv`;
    one below it, inside `_pre`. Both give the module forward's logits, positions past the
    first chunk included."""
    calls = []

    def heads(qkv, positions, *args, **kwargs):
        calls.append((qkv.shape[0], int(positions[0])))
        return _mlx_heads(qkv, positions, *args, **kwargs)

    model, rng = gemma.model, np.random.default_rng(5)
    jobs = [[2, *[int(t) for t in rng.integers(3, 100_000, n - 1)]] for n in (130, 70)]
    args = model.args
    width = (args.num_attention_heads + 2 * args.num_key_value_heads) * args.head_dim
    monkeypatch.setattr(_gemma3_graph, "HEADS_KERNEL_MIN", 64 * width)  # 64 rows
    _assert_scores_as_alone(model, GraphForward(_mlx_attend, _mlx_attend_fresh, None, heads),
                            jobs, 65, packed)
    # one job: 65 rows at 0 and 65 (130 tokens), 65 at 0 (70 tokens), not the last 5 rows;
    # packed: 65 + 65 rows padded to 256, then 65 + 5 at 65 padded to 128 (no job is at 0
    # there, so the padding pseudo-job's rows, at 0, come first)
    want = [(65, 0), (65, 65), (65, 0)] if not packed else [(256, 0), (128, 0)]
    assert sorted(calls) == sorted(want * args.num_hidden_layers)


@pytest.mark.parametrize("fresh", [False, True], ids=["job-by-job", "fresh-in-one-call"])
@pytest.mark.parametrize("chunk", [5, 37])  # inside and past the 16-token window
def test_packed_compiled_graphs_equal_each_job_alone_on_the_tiny_model(tiny, chunk, fresh):
    model, rng = tiny.model, np.random.default_rng(chunk)
    # mixed lengths: jobs drop out of later steps, the others' positions run on; the
    # fourth joins later, at position 0 beside jobs past it
    jobs = [[int(t) for t in rng.integers(3, tiny.vocab_size, n)] for n in (90, 3, 41, 17)]
    forward = GraphForward(_mlx_attend, _mlx_attend_fresh if fresh else None)
    packed = _packed_logits(model, forward, jobs, chunk, joins={3: 1})
    for ids, out in zip(jobs, packed, strict=True):
        ref = _logits(model, ids, chunk)
        assert float(np.abs(out - ref).max()) <= GRAPH_BOUND * float(np.abs(ref).max())
        assert int(out.argmax()) == int(ref.argmax())


def test_packed_compiled_graphs_equal_each_job_alone_on_gemma3_270m(gemma):
    rng = np.random.default_rng(2)
    jobs = [[2, *[int(t) for t in rng.integers(3, 100_000, n - 1)]] for n in (700, 45, 300)]
    packed = _packed_logits(gemma.model, GraphForward(_mlx_attend, _mlx_attend_fresh), jobs,
                            300, joins={1: 1})
    for ids, out in zip(jobs, packed, strict=True):
        ref = _logits(gemma.model, ids, 300)
        assert float(np.abs(out - ref).max()) <= GRAPH_BOUND * float(np.abs(ref).max())
        assert int(out.argmax()) == int(ref.argmax())


def test_a_fresh_job_that_keeps_no_cache_writes_no_rows_and_scores_the_same(tiny):
    model, rng = tiny.model, np.random.default_rng(5)
    jobs = [[int(t) for t in rng.integers(3, tiny.vocab_size, n)] for n in (40, 12, 9)]
    caches = [model.make_cache(mx.float32, capacity=len(ids)) for ids in jobs]
    outs = GraphForward(_mlx_attend, _mlx_attend_fresh).packed(
        model, [mx.array(ids, dtype=mx.int32) for ids in jobs], caches,
        writes=[True, False, True])
    mx.eval(outs, *(c.arrays() for c in caches))
    for ids, out in zip(jobs, outs, strict=True):
        ref = _logits(model, ids, len(ids))
        got = np.array(model.logits(out)[0])
        assert float(np.abs(got - ref).max()) <= GRAPH_BOUND * float(np.abs(ref).max())
    written = [any(bool(mx.any(a != 0)) for a in c.arrays()) for c in caches]
    assert written == [True, False, True]


def test_padded_rows_repeat_a_few_shapes():
    assert [padded_rows(n) for n in (1, 32, 33, 200, 256, 257, 700, 8192)] == [
        32, 32, 64, 256, 256, 512, 768, 8192]
    assert len({padded_rows(n) for n in range(1, 8193)}) == 35


def test_packed_steps_of_different_rows_run_one_padded_shape_and_score_the_same(tiny):
    """Steps of 300 and 400 real rows both run 512 (the compiled graphs and the fresh
    attention see one shape); the padding rows change no job's logits beyond the bound."""
    model, rng = tiny.model, np.random.default_rng(7)
    seen = []

    def attend_fresh(q, k, v, scale, lengths, window):
        seen.append((q.shape[2], lengths))
        return _mlx_attend_fresh(q, k, v, scale, lengths, window)

    forward = GraphForward(_mlx_attend, attend_fresh)
    for lengths in ((100, 200), (150, 250)):
        jobs = [[int(t) for t in rng.integers(3, tiny.vocab_size, n)] for n in lengths]
        caches = [model.make_cache(mx.float32, capacity=n) for n in lengths]
        outs = forward.packed(model, [mx.array(ids, dtype=mx.int32) for ids in jobs], caches)
        mx.eval(outs)
        for ids, out in zip(jobs, outs, strict=True):
            ref = _logits(model, ids, len(ids))
            got = np.array(model.logits(out)[0])
            assert float(np.abs(got - ref).max()) <= GRAPH_BOUND * float(np.abs(ref).max())
            assert int(got.argmax()) == int(ref.argmax())
        mx.eval(*(c.arrays() for c in caches))
    assert [rows for rows, _ in seen[:: len(model.blk)]] == [512, 512]
    assert [lengths for _, lengths in seen[:: len(model.blk)]] == [(100, 200, 212),
                                                                    (150, 250, 112)]
