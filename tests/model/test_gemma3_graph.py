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
from model.kernels.flash_attention import PackedJob
from tests.model.graph_harness import (
    GRAPH_BOUND,
    assert_scores_as_alone,
    logits_alone,
    mlx_attend,
    mlx_attend_packed,
    mlx_gate,
    mlx_heads,
)


@pytest.mark.parametrize("chunk", [5, 16, 37])  # inside, at and past the 16-token window
def test_the_compiled_graphs_equal_the_module_forward_on_the_tiny_model(tiny, chunk):
    model = tiny.model
    ids = [int(t) for t in np.random.default_rng(chunk).integers(3, tiny.vocab_size, 90)]
    ref = logits_alone(model, ids, chunk)
    out = logits_alone(model, ids, chunk, GraphForward(mlx_attend))
    assert float(np.abs(out - ref).max()) <= GRAPH_BOUND * float(np.abs(ref).max())
    assert int(out.argmax()) == int(ref.argmax())


def test_the_compiled_graphs_equal_the_module_forward_on_gemma3_270m(gemma):
    ids = [2, *[int(t) for t in np.random.default_rng(1).integers(3, 100_000, 699)]]
    ref = logits_alone(gemma.model, ids, 300)
    out = logits_alone(gemma.model, ids, 300, GraphForward(mlx_attend))
    assert float(np.abs(out - ref).max()) <= GRAPH_BOUND * float(np.abs(ref).max())
    assert int(out.argmax()) == int(ref.argmax())


def test_the_cpu_runs_the_module_forward(tiny):
    cache = tiny.model.make_cache(mx.float32, capacity=8)
    assert not gemma3.graph_applies(tiny.model, cache)


@pytest.mark.parametrize("packed", [False, True], ids=["one-job", "packed"])
def test_the_gate_between_two_compiled_halves_scores_as_the_one_compiled_post(
        tiny, monkeypatch, packed):
    """A layer whose gated product reaches `GATE_KERNEL_MIN` values runs the ``gate``
    between `_attn_out` and `_mlp_out`; one below it, inside `_post`. Both give the module
    forward's logits."""
    calls = []

    def gate(gate_up):
        calls.append(gate_up.shape)
        return mlx_gate(gate_up)

    model, rng = tiny.model, np.random.default_rng(4)
    jobs = [[int(t) for t in rng.integers(3, tiny.vocab_size, n)] for n in (40, 23)]
    width = 2 * model.args.intermediate_size
    monkeypatch.setattr(_gemma3_graph, "GATE_KERNEL_MIN", 24 * width // 2)  # 24 rows
    assert_scores_as_alone(model, GraphForward(mlx_attend, mlx_attend_packed, gate), jobs,
                            30, packed)
    assert {s[-1] for s in calls} == {width}
    # one job: its 30-row chunk through the gate, the 10- and 23-row ones inside `_post`;
    # packed: 30 + 23 rows padded to 64, then 10 padded to 32
    rows = {shape[-2] for shape in calls}
    assert rows == ({64, 32} if packed else {30})


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
        return mlx_heads(qkv, positions, *args, **kwargs)

    model, rng = gemma.model, np.random.default_rng(5)
    jobs = [[2, *[int(t) for t in rng.integers(3, 100_000, n - 1)]] for n in (130, 70)]
    args = model.args
    width = (args.num_attention_heads + 2 * args.num_key_value_heads) * args.head_dim
    monkeypatch.setattr(_gemma3_graph, "HEADS_KERNEL_MIN", 64 * width)  # 64 rows
    assert_scores_as_alone(model, GraphForward(mlx_attend, mlx_attend_packed, None, heads),
                            jobs, 65, packed)
    # one job: 65 rows at 0 and 65 (130 tokens), 65 at 0 (70 tokens), not the last 5 rows;
    # packed: 65 + 65 rows padded to 256, then 65 + 5 at 65 padded to 128 (no job is at 0
    # there, so the padding pseudo-job's rows, at 0, come first)
    want = [(65, 0), (65, 65), (65, 0)] if not packed else [(256, 0), (128, 0)]
    assert sorted(calls) == sorted(want * args.num_hidden_layers)


# A packed step's attention: job by job; the first chunks in one call and later chunks on
# their own (``shared_kv_bytes=0``, as before 2026-12-06); every chunk in one call.
ATTENTION = {"job-by-job": (None, 0), "first-chunks-in-one-call": (mlx_attend_packed, 0),
             "all-in-one-call": (mlx_attend_packed, 1 << 30)}


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("chunk", [5, 37])  # inside and past the 16-token window
def test_packed_compiled_graphs_equal_each_job_alone_on_the_tiny_model(tiny, chunk, attention):
    model, rng = tiny.model, np.random.default_rng(chunk)
    # mixed lengths: jobs drop out of later steps, the others' positions run on; the
    # fourth joins later, at position 0 beside jobs past it
    jobs = [[int(t) for t in rng.integers(3, tiny.vocab_size, n)] for n in (90, 3, 41, 17)]
    attend_packed, shared = ATTENTION[attention]
    forward = GraphForward(mlx_attend, attend_packed, shared_kv_bytes=shared)
    assert_scores_as_alone(model, forward, jobs, chunk, packed=True, joins={3: 1})


@pytest.mark.parametrize("attention", list(ATTENTION)[1:])
def test_packed_compiled_graphs_equal_each_job_alone_on_gemma3_270m(gemma, attention):
    rng = np.random.default_rng(2)
    jobs = [[2, *[int(t) for t in rng.integers(3, 100_000, n - 1)]] for n in (700, 45, 300)]
    attend_packed, shared = ATTENTION[attention]
    forward = GraphForward(mlx_attend, attend_packed, shared_kv_bytes=shared)
    assert_scores_as_alone(gemma.model, forward, jobs, 300, packed=True, joins={1: 1})


def _recording(calls: list):
    """`mlx_attend_packed`, each call's jobs appended to `calls`."""
    def attend_packed(q, keys, values, scale, jobs, window):
        calls.append(jobs)
        return mlx_attend_packed(q, keys, values, scale, jobs, window)
    return attend_packed


def test_later_chunks_share_the_first_chunks_launch_up_to_their_kv_bytes(tiny):
    """A step of a first chunk and two later ones: each layer makes one call of the first
    chunk (then the padding) and the later chunk whose keys and values fit
    ``shared_kv_bytes``, in that order, each with the keys its cache returned (a sliding
    layer's window, a global layer's every row); the other later chunk attends on its own.
    Each job's logits are its own alone."""
    model, rng = tiny.model, np.random.default_rng(11)
    args = model.args
    row_bytes = 2 * args.num_key_value_heads * args.head_dim * 2
    jobs = [[int(t) for t in rng.integers(3, tiny.vocab_size, n)] for n in (60, 45, 20)]
    calls = []
    # job 1 at 40 + 5 rows fits, job 0 at 40 + 20 does not; 45 rows padded by 19
    forward = GraphForward(mlx_attend, _recording(calls), shared_kv_bytes=45 * row_bytes)
    caches = [model.make_cache(mx.float32, capacity=len(ids)) for ids in jobs]
    for i in (0, 1):  # both 40 tokens in, alone
        logits_alone(model, jobs[i][:40], 40, cache=caches[i])
    calls.clear()
    outs = forward.packed(model, [mx.array(ids[40:] if i < 2 else ids, dtype=mx.int32)
                                  for i, ids in enumerate(jobs)], caches)
    mx.eval(outs)
    window = args.sliding_window
    sliding = [PackedJob(20, 20, 0), PackedJob(19, 19, 0), PackedJob(5, window - 1 + 5, 40)]
    whole = [PackedJob(20, 20, 0), PackedJob(19, 19, 0), PackedJob(5, 45, 40)]
    want = [tuple(whole if a.window is None else sliding) for a in (b.attn for b in model.blk)]
    assert calls == want
    for ids, out in zip(jobs, outs, strict=True):
        ref = logits_alone(model, ids, len(ids))
        got = np.array(model.logits(out)[0])
        assert float(np.abs(got - ref).max()) <= GRAPH_BOUND * float(np.abs(ref).max())


def test_a_lone_later_chunk_attends_on_its_own(tiny):
    """Later chunks without a first chunk beside them: two share a call; one alone does not
    (the fused kernel may split its keys on its own), and only the padding's rows are in
    the shared call."""
    model, rng = tiny.model, np.random.default_rng(12)
    calls = []
    forward = GraphForward(mlx_attend, _recording(calls), shared_kv_bytes=1 << 30)
    for n_jobs, want in ((2, [PackedJob(22, 22, 0), PackedJob(5, 15 + 5, 20),
                              PackedJob(5, 15 + 5, 20)]), (1, [PackedJob(27, 27, 0)])):
        caches = [model.make_cache(mx.float32, capacity=25) for _ in range(n_jobs)]
        jobs = [[int(t) for t in rng.integers(3, tiny.vocab_size, 25)] for _ in caches]
        for ids, cache in zip(jobs, caches, strict=True):
            logits_alone(model, ids[:20], 20, cache=cache)
        calls.clear()
        mx.eval(forward.packed(model, [mx.array(ids[20:], dtype=mx.int32) for ids in jobs],
                               caches))
        assert calls[0] == tuple(want), n_jobs


def test_a_fresh_job_that_keeps_no_cache_writes_no_rows_and_scores_the_same(tiny):
    model, rng = tiny.model, np.random.default_rng(5)
    jobs = [[int(t) for t in rng.integers(3, tiny.vocab_size, n)] for n in (40, 12, 9)]
    caches = [model.make_cache(mx.float32, capacity=len(ids)) for ids in jobs]
    outs = GraphForward(mlx_attend, mlx_attend_packed).packed(
        model, [mx.array(ids, dtype=mx.int32) for ids in jobs], caches,
        writes=[True, False, True])
    mx.eval(outs, *(c.arrays() for c in caches))
    for ids, out in zip(jobs, outs, strict=True):
        ref = logits_alone(model, ids, len(ids))
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

    def attend_packed(q, k, v, scale, jobs, window):
        seen.append((q.shape[2], tuple(job.rows for job in jobs)))
        return mlx_attend_packed(q, k, v, scale, jobs, window)

    forward = GraphForward(mlx_attend, attend_packed)
    for lengths in ((100, 200), (150, 250)):
        jobs = [[int(t) for t in rng.integers(3, tiny.vocab_size, n)] for n in lengths]
        caches = [model.make_cache(mx.float32, capacity=n) for n in lengths]
        outs = forward.packed(model, [mx.array(ids, dtype=mx.int32) for ids in jobs], caches)
        mx.eval(outs)
        for ids, out in zip(jobs, outs, strict=True):
            ref = logits_alone(model, ids, len(ids))
            got = np.array(model.logits(out)[0])
            assert float(np.abs(got - ref).max()) <= GRAPH_BOUND * float(np.abs(ref).max())
            assert int(got.argmax()) == int(ref.argmax())
        mx.eval(*(c.arrays() for c in caches))
    assert [rows for rows, _ in seen[:: len(model.blk)]] == [512, 512]
    assert [lengths for _, lengths in seen[:: len(model.blk)]] == [(100, 200, 212),
                                                                    (150, 250, 112)]


def test_later_chunks_share_the_launch_up_to_8_mib_unless_told_otherwise(monkeypatch):
    """By default a later chunk's keys and values may take 8 MiB in the shared launch; the
    variable sets another size (0: never); anything else is a clear error."""
    monkeypatch.delenv(_gemma3_graph.SHARED_KV_BYTES_ENV, raising=False)
    assert _gemma3_graph.shared_kv_bytes() == _gemma3_graph.SHARED_KV_BYTES == 8 << 20
    monkeypatch.setenv(_gemma3_graph.SHARED_KV_BYTES_ENV, "0")
    assert _gemma3_graph.shared_kv_bytes() == 0
    monkeypatch.setenv(_gemma3_graph.SHARED_KV_BYTES_ENV, "8M")
    with pytest.raises(ValueError, match="PREFILLQ_SHARED_KV_BYTES must be an integer"):
        _gemma3_graph.shared_kv_bytes()


def test_a_bad_shared_kv_bytes_stops_the_model_at_its_build(monkeypatch, tiny):
    """Read when a Gemma 3 model is built (a worker's start), not at its first CUDA step."""
    monkeypatch.setenv(_gemma3_graph.SHARED_KV_BYTES_ENV, "off")
    with pytest.raises(ValueError, match="PREFILLQ_SHARED_KV_BYTES must be an integer"):
        gemma3.Model(tiny.model.args)
