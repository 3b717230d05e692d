"""DeepSeek-V4 on a CUDA GPU: exactness checks, micro-benchmarks of the fused key-list kernel
(`model.kernels.sparse_attention`) and of the routed experts, and an ablation.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from functools import partial

import mlx.core as mx
import numpy as np

from model.archs import deepseek4
from model.archs.deepseek4 import layers as ds_layers
from model.archs.deepseek4 import model as ds_model
from model.archs.deepseek4.sparse import gathered_attention
from model.kernels import flash_attention_sm90 as sm90
from model.kernels import sparse_attention as sa

from .common import Recorder, interleaved, log, patched
from .gpu_attention import BF16_TOLERANCE, _interleaved_seconds, _seconds

H, D = 64, 512
# One attention layer through two paths (the kernel's bf16 P and its own summation order
# against MLX's): the kernel alone is within BF16_TOLERANCE of float32, and the output
# projection adds a bf16 rounding; a wrong window row, compressed row or top-k choice
# moves the output by O(1) of its scale.
LAYER_TOLERANCE = 3e-2

SPARSE_CHECKS = [  # (queries, slots per query, rows, share of empty slots, heads)
    (1, 128, 300, 0.0, H), (100, 192, 500, 0.3, H), (2048, 640, 4224, 0.1, H),
    (37, 640, 700, 0.9, H), (5, 33, 40, 0.0, H),  # a partial last tile
    (3, 1, 10, 0.0, H), (7, 65, 100, 0.0, H),  # one slot; one past a 64-slot tile
    (9, 200, 400, 0.0, 2 * H),  # two blocks of 64 heads
]


def _sparse_inputs(L: int, K: int, N: int, empty: float, heads: int = H, seed: int = 0):
    rng = np.random.default_rng(seed + L)
    q = mx.random.normal((1, heads, L, D), key=mx.random.key(seed + L)).astype(mx.bfloat16)
    kv = mx.random.normal((N, D), key=mx.random.key(seed + N)).astype(mx.bfloat16)
    idx = np.stack([rng.choice(N, K, replace=False) for _ in range(L)]).astype(np.int32)
    idx[rng.random(idx.shape) < empty] = -1
    if L > 1 and K >= 128:
        idx[1, 64:128] = -1  # query 1: a whole tile of empty slots between full ones
    sinks = mx.array(rng.standard_normal(heads), dtype=mx.float32)
    return q, kv, mx.array(idx), sinks


def check_sparse_kernel(rec: Recorder) -> bool:
    """The kernel against `gathered_attention` (float32 on the same bf16 inputs) at
    DeepSeek-V4-Flash's attention shape (64 heads of 512, one KV head; one case of 128),
    lists of window, dense-compressed and top-k shapes with empty slots (a whole empty tile
    among full ones), one slot, a query with no key, random sinks; max |difference| over max
    |reference| within `BF16_TOLERANCE`. On a compute capability 9.0 GPU the sm_90a build
    too, at both of its step sizes (``path``).
    """
    paths = [("mma.sync", {"hopper": False})]
    if sm90.compute_capability() == (9, 0):
        paths += [("sm90 wgmma", {"hopper": True, "block_n": n}) for n in (64, 32)]
    return all([_check_sparse_path(rec, path, kwargs) for path, kwargs in paths])


def _check_sparse_path(rec: Recorder, path: str, kwargs: dict) -> bool:
    ok = True
    for L, K, N, empty, heads in SPARSE_CHECKS:
        q, kv, idx, sinks = _sparse_inputs(L, K, N, empty, heads)
        if L > 1:
            idx[0] = -1  # query 0 sees no key: zeros
        ours = sa.sparse_attention(q, kv, idx, sinks, D**-0.5, **kwargs).astype(mx.float32)
        ref = gathered_attention(q.astype(mx.float32), kv.astype(mx.float32), idx, sinks,
                                 D**-0.5)
        diff = float(mx.abs(ours - ref).max() / mx.abs(ref).max())
        good = diff <= BF16_TOLERANCE and not mx.isnan(ours).any().item()
        if L > 1:
            good &= float(mx.abs(ours[0]).max()) == 0.0
        ok &= good
        rec("sparse_attention_check", diff, "max|diff|/max|ref|", ceiling=BF16_TOLERANCE,
            heads=heads, head_dim=D, queries=L, slots=K, rows=N, empty_share=empty, path=path,
            block_n=kwargs.get("block_n", sa.DEFAULT_BLOCK_N), holds=good)
    return ok


@contextmanager
def masked_dense():
    """DeepSeek-V4 attention as it ran before the kernel: MLX's attention over every key
    under a mask (compressed rows included), no gathering; restored on exit."""
    with patched(sa, "applies", lambda q, kv: False), \
            patched(ds_model.Attention, "gather_top_k", False):
        yield


def _layer_outputs(model, layer: int, xs: list[mx.array]) -> list[mx.array]:
    cache = model.make_cache(xs[0].dtype, capacity=sum(x.shape[1] for x in xs))
    attention, outs = model.blk[layer].attn, []
    for x in xs:
        out = attention(x, cache[layer], cache.position)
        mx.eval(out, cache.arrays())
        cache.commit(x.shape[1])
        outs.append(out)
    return outs


def check_gathered_layers(rec: Recorder, n: int = 8192, chunk: int = 2048, args=None,
                          dtype: mx.Dtype = mx.bfloat16) -> bool:
    """Args: `args` (default `deepseek4.flash_args()`, 8 routed experts: only attention
    runs) and `dtype` of the weights, inputs and cache (a CPU test passes tiny float32).

    Each attention layer kind of DeepSeek-V4-Flash (ratio 0, 4 and 128) run chunk by chunk
    over 8,192 tokens through the product's path (the kernel, the indexer's top-k rows
    gathered) and through the masked dense form (`masked_dense`), each with its own cache;
    every chunk's output within `LAYER_TOLERANCE`.
    """
    args = args or deepseek4.flash_args(n_routed_experts=8)
    model = deepseek4.dummy_model(args, n_layers=4, dtype=dtype)
    ratios = model.args.compress_ratios
    key = mx.random.key(3)
    xs = [mx.random.normal((1, chunk, model.args.hidden_size), key=k).astype(dtype)
          for k in mx.random.split(key, n // chunk)]
    ok = True
    for ratio in (0, 4, 128):
        layer = ratios.index(ratio)
        fused = _layer_outputs(model, layer, xs)
        with masked_dense():
            dense = _layer_outputs(model, layer, xs)
        for i, (a, b) in enumerate(zip(fused, dense, strict=True)):
            diff = float(mx.abs(a - b).max() / mx.abs(b).max())
            good = diff <= LAYER_TOLERANCE and not mx.isnan(a).any().item()
            ok &= good
            rec("deepseek4_attention_layer_check", diff, "max|diff|/max|ref|",
                ceiling=LAYER_TOLERANCE, ratio=ratio, layer=layer, chunk_index=i,
                position=i * chunk, chunk_tokens=chunk,
                reference_finite=not mx.isnan(b).any().item())
    return ok


def micro(rec: Recorder, L: int = 2048, position: int = 6144, topk: int = 512,
          window: int = 128) -> None:
    """One ratio-4 layer's attention, the chunk at `position` (`position + L` tokens in).

    A 2,048-token chunk at 8K (window 128 + top-k 512 per query): the kernel (on a compute
    capability 9.0 GPU its sm_90a build too, at both step sizes), `gathered_attention` in
    MLX ops, and the masked dense MLX attention the model ran before. The kernels are timed
    in turn (`bench.gpu_attention._interleaved_seconds`: ten calls a sample, so the host's
    graph building and launch are off the clock), the MLX paths a call at a time.
    """
    n_rows = (position + L) // 4
    n_prev = window - 1
    N = n_prev + L + n_rows
    rng = np.random.default_rng(0)
    q = mx.random.normal((1, H, L, D)).astype(mx.bfloat16)
    kv = mx.random.normal((N, D)).astype(mx.bfloat16)
    sinks = mx.zeros((H,), dtype=mx.float32)
    win = np.arange(L)[:, None] + np.arange(window)[None, :]  # rows of each query's window
    top = np.stack([rng.choice(n_rows, topk, replace=False) for _ in range(L)])
    idx = mx.array(np.concatenate([win, n_prev + L + top], axis=1).astype(np.int32))
    mask = np.zeros((L, N), dtype=bool)
    np.put_along_axis(mask, np.array(idx), True, axis=1)
    mask = mx.array(mask)
    flops = 2 * 2 * H * D * L * (window + topk)
    keys = kv[None, None]
    hopper = {} if sm90.compute_capability() != (9, 0) else {
        f"prefillq fused sm90 wgmma, {n} slots a step": lambda n=n: sa.sparse_attention(
            q, kv, idx, sinks, D**-0.5, block_n=n, hopper=True) for n in (64, 32)}
    kernels = {
        "prefillq fused": lambda: sa.sparse_attention(q, kv, idx, sinks, D**-0.5, hopper=False),
        **hopper}
    seconds = _interleaved_seconds(kernels)
    for impl, fn in (
            ("gathered mlx ops", lambda: gathered_attention(q, kv, idx, sinks, D**-0.5)),
            ("mlx sdpa masked dense", lambda: mx.fast.scaled_dot_product_attention(
                q, keys, keys, scale=D**-0.5, mask=mask, sinks=sinks.astype(q.dtype)))):
        seconds[impl] = _seconds(fn)  # 13-17 ms each, and ten would hold ~30 GB at once
    for impl, s in seconds.items():
        rec("deepseek4_attention_seconds", s, "s", impl=impl, queries=L, position=position,
            slots=window + topk, keys=N, tflops_useful=round(flops / s / 1e12, 1))
    mx.clear_cache()
    log("deepseek4 attention micro-benchmark done")


# (slots per query, key rows): a ratio-0 layer's window (128), then longer lists up to a
# ratio-4 layer's window + top-k (640) and past it
SLOT_SWEEP = [(128, 2175), (256, 4000), (640, 4223), (1152, 9000)]


def slots_sweep(rec: Recorder, L: int = 2048, cases=SLOT_SWEEP) -> None:
    """The key-list kernel's builds (mma.sync at 32 and 16 slots a step; on a compute
    capability 9.0 GPU sm_90a at 64 and 32) over `L` queries of 64 heads by list length,
    timed in turn as kernels (`_interleaved_seconds`) on `_sparse_inputs` with no empty
    slot but the checks' one tile of query 1: ``deepseek4_slots_seconds`` each."""
    builds = [("mma.sync", 32), ("mma.sync", 16)]
    if sm90.compute_capability() == (9, 0):
        builds += [("sm90 wgmma", 64), ("sm90 wgmma", 32)]
    for K, N in cases:
        q, kv, idx, sinks = _sparse_inputs(L, K, N, empty=0.0)
        runs = {(path, n): partial(sa.sparse_attention, q, kv, idx, sinks, D**-0.5, block_n=n,
                                   hopper=path != "mma.sync") for path, n in builds}
        for (path, n), s in _interleaved_seconds(runs).items():
            rec("deepseek4_slots_seconds", s, "s", path=path, block_n=n, queries=L, slots=K,
                rows=N, tflops_useful=round(2 * 2 * H * D * L * K / s / 1e12, 1))
    mx.clear_cache()


def _routed_layer(args, dtype: mx.Dtype, seed: int = 0):
    """A routed MoE layer at `args`' widths with random `dtype` expert weights (std 0.02)."""
    moe = deepseek4.MoE(args, layer=args.num_hash_layers)
    E, F, Hd = args.n_routed_experts, args.moe_intermediate_size, args.hidden_size
    keys = mx.random.split(mx.random.key(seed), 3)
    for key, name, shape in zip(keys, ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"),
                                ((E, F, Hd), (E, F, Hd), (E, Hd, F)), strict=True):
        getattr(moe, name).weight = (mx.random.normal(shape, key=key) * 0.02).astype(dtype)
    return moe


def _routing(args, L: int, dtype: mx.Dtype, hot: int = 0, seed: int = 0):
    """A chunk's `L` tokens for `_routed_layer`: ``x`` ``(L, H)``, int32 top-k ids ``(L,
    k)`` (distinct, uniformly random; expert 0 also in the first `hot` tokens' lists, as
    skewed routing piles tokens onto one expert), weights ``(L, k)``."""
    E, Hd, k = args.n_routed_experts, args.hidden_size, args.num_experts_per_tok
    rng = np.random.default_rng(seed + L + hot)
    inds = np.argsort(rng.random((L, E)), axis=-1)[:, :k]
    for row in inds[:hot]:
        if 0 not in row:
            row[0] = 0
    x = mx.random.normal((L, Hd), key=mx.random.key(seed + L)).astype(dtype)
    return x, mx.array(inds.astype(np.int32)), mx.full((L, k), 1.0 / k, dtype=dtype)


def _routed_inputs(args, L: int, dtype: mx.Dtype, seed: int = 0):
    """`_routed_layer` and an `L`-token `_routing` for it."""
    return (_routed_layer(args, dtype, seed), *_routing(args, L, dtype, seed=seed))


def check_padded_experts(rec: Recorder, L: int = 512, args=None,
                         dtype: mx.Dtype = mx.bfloat16) -> bool:
    """Both GPU expert paths against float32 host-grouped matmuls (`MoE._grouped`) on the
    same `dtype` inputs: `L` tokens over `args`' experts (default Flash's width with 64
    experts: ~48 rows each, as a 2,048-token chunk over 256), max |difference| over max
    |reference| within `BF16_TOLERANCE` (a CPU test passes float32: MLX's CPU ``gather_mm``
    takes nothing else)."""
    args = args or deepseek4.flash_args(n_routed_experts=64)
    n_experts = args.n_routed_experts
    moe, x, inds, weights = _routed_inputs(args, L, dtype)
    ref_moe = deepseek4.MoE(args, layer=args.num_hash_layers)
    for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        getattr(ref_moe, name).weight = getattr(moe, name).weight.astype(mx.float32)
    ref = ref_moe._grouped(x.astype(mx.float32), inds, weights.astype(mx.float32))
    ok = True
    for path, fn in (("padded", moe._padded), ("gathered", moe._gathered)):
        out = fn(x, inds, weights).astype(mx.float32)
        diff = float(mx.abs(out - ref).max() / mx.abs(ref).max())
        good = diff <= BF16_TOLERANCE and not mx.isnan(out).any().item()
        ok &= good
        rec("deepseek4_experts_check", diff, "max|diff|/max|ref|", ceiling=BF16_TOLERANCE,
            path=path, tokens=L, experts=n_experts, top_k=args.num_experts_per_tok)
    return ok


def experts_micro(rec: Recorder, L: int = 2048) -> None:
    """One layer's routed experts at DeepSeek-V4-Flash shapes (256 experts of 4096 x 2048,
    top-6) for an `L`-token chunk, each path the best of 5 after a warm-up."""
    args = deepseek4.flash_args()
    _time_experts(rec, _routed_layer(args, mx.bfloat16), args, L, hot=0)
    log("deepseek4 experts micro-benchmark done")


# (tokens, hot): uniform routing from 1 token up, then 2,048 tokens with expert 0 in the
# first `hot` lists (its count ~48 + hot against a mean of 48): the 18 cases of the two
# committed runs (bench/results/gpu-h200-2026-12-01-experts-sweep{,-small}.jsonl)
EXPERT_SWEEP = [(1, 0), (2, 0), (4, 0), (8, 0), (16, 0), (32, 0), (64, 0), (256, 0),
                (1024, 0), (2048, 0), (2048, 64), (2048, 128), (2048, 256), (2048, 384),
                (2048, 512), (2048, 768), (2048, 1024), (2048, 2048)]


def experts_sweep(rec: Recorder, cases=EXPERT_SWEEP) -> None:
    """Both GPU expert paths over `cases` of chunk length and skew, the padded layout forced
    (`MIN_PAIRS` and `PAD_LIMIT` lifted), each record with its padded rows over the real
    pairs: where `MoE._padded` stops paying is where `padded_capacity` declines."""
    args = deepseek4.flash_args()
    moe = _routed_layer(args, mx.bfloat16)
    with patched(deepseek4.moe, "PAD_LIMIT", float("inf")), \
            patched(deepseek4.moe, "MIN_PAIRS", 0):
        for L, hot in cases:
            _time_experts(rec, moe, args, L, hot)
    log("deepseek4 experts sweep done")


def _time_experts(rec: Recorder, moe, args, L: int, hot: int) -> None:
    x, inds, weights = _routing(args, L, mx.bfloat16, hot)
    E, F, Hd, k = (args.n_routed_experts, args.moe_intermediate_size, args.hidden_size,
                   args.num_experts_per_tok)
    counts = np.bincount(np.array(inds).reshape(-1), minlength=E)
    cap = deepseek4.moe.busiest_rows(counts)
    flops = 2 * 3 * L * k * F * Hd
    weight_bytes = 3 * E * F * Hd * 2
    for path, fn in (("padded", moe._padded), ("gathered", moe._gathered)):
        s = _seconds(lambda fn=fn: fn(x, inds, weights))
        rec("deepseek4_experts_seconds", s, "s", path=path, tokens=L, experts=E, top_k=k,
            hot_rows=hot, busiest=int(counts.max()),
            padded_rows_over_pairs=round(E * cap / (L * k), 2),
            tflops_useful=round(flops / s / 1e12, 1),
            weights_tb_s=round(weight_bytes / s / 1e12, 2))


ABLATIONS = {  # variant: (owner, attribute, replacement), or None for the product's path
    "baseline": None,
    "experts_gathered": (deepseek4.moe, "expert_path", lambda: "gathered"),
    "host_angle_tables": (ds_layers, "angle_table", ds_layers.host_angles),  # as it was
    # the mma.sync key-list kernel where the sm_90a one is the default (the same elsewhere)
    "sparse_mma_sync": (sa, "sparse_attention", partial(sa.sparse_attention, hopper=False)),
}


def ablate(rec: Recorder, n: int = 8192, chunk: int = 2048, repeats: int = 3,
           n_layers: int = 4, args=None, dtype: mx.Dtype = mx.bfloat16) -> None:
    """Tokens per second of each of `ABLATIONS` on the first `n_layers` layers of `args`
    (default DeepSeek-V4-Flash; random `dtype` weights), `n` tokens in `chunk`-token
    chunks, the variants alternating in one process, each the fastest of `repeats`, with
    its ratio to ``baseline``."""
    from .gpu import one_prefill_seconds  # it imports this module

    net = deepseek4.dummy_model(args or deepseek4.flash_args(), n_layers=n_layers, dtype=dtype)

    def run(patch):
        def go():
            with patched(*patch) if patch else nullcontext():
                return one_prefill_seconds(net, n, chunk)
        return go

    runs = [run(patch) for patch in ABLATIONS.values()]
    for go in runs:  # warm-up: kernels compiled, allocator grown
        go()
    seconds = interleaved(*runs, repeats=repeats)
    for name, s in zip(ABLATIONS, seconds, strict=True):
        rec("deepseek4_ablation_tok_s", n / s, "tok/s", variant=name, layers=n_layers,
            n_tokens=n, chunk_tokens=chunk, over_baseline=round(seconds[0] / s, 3))
