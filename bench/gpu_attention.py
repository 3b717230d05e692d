"""python -m bench.gpu_attention [--check] [--sweep] [--sweep-plan] [--out FILE]

The fused CUDA attention kernel (`model.kernels.flash_attention`) on the device: exactness
against the unfused MLX path (`check`) and TFLOP/s against MLX and torch SDPA (`micro`).
"""

from __future__ import annotations

import datetime
import functools
import os
import time
from collections.abc import Iterable
from typing import NamedTuple

import mlx.core as mx

from model.archs._attention import blocked_attention
from model.kernels import flash_attention as fa
from model.kernels import flash_attention_sm90 as sm90
from model.kernels.flash_attention import (
    MIN_KEY_BLOCKS_PER_SPLIT,
    SM90_BLOCK_N,
    SM90_WARPS,
    PackedJob,
    available,
    block_keys,
    flash_attention,
    grid_plan,
    packed_flash_attention,
    plan,
)

from .common import (
    Recorder,
    bench_parser,
    causal_attention_flops,
    git_commit,
    log,
    patched,
    refuse_existing,
)
from .gpu_peers import attention_plan, attention_ratios, run_all

# bf16 keeps 8 significant bits (relative step 2^-8 ~ 3.9e-3); P is rounded to bf16 before
# P V, as in FlashAttention-2, and the output once more.
BF16_TOLERANCE = 2e-2

# The micro-benchmark's shape and timing, which torch SDPA's peer processes are given too:
# the fastest of `repeats` samples, each `batch` calls queued back to back (so the kernels
# are timed, not the host's launches: at 8K an MLX call's graph and launch cost ~0.2 ms
# beside the kernel's ~0.4)
MICRO = {"queries": (8192, 32_768), "heads": 4, "kv_heads": 1, "head_dim": 256, "repeats": 5,
         "batch": 4}

CHECKS = [  # (H, KVH, L, position, window)
    (4, 1, 1000, 0, None), (4, 1, 2048, 0, None), (4, 1, 2048, 6144, None),
    (4, 1, 777, 3001, None), (4, 4, 513, 100, None), (4, 1, 2048, 0, 512),
    (4, 1, 2048, 8192, 512), (4, 1, 300, 5000, 512), (8, 2, 1024, 2048, 1024),
    (4, 1, 8192, 0, None), (4, 1, 8192, 0, 512),  # enough query blocks: no key split
    (4, 1, 64, 16_384, None), (4, 1, 1, 8191, None),  # short chunks, long keys: 8 splits
    (8, 4, 2048, 30_720, None), (8, 4, 2048, 6144, 1024),  # Gemma 3 4B's last chunk of 32K
    (1, 1, 8192, 0, None),  # one head: 3 key splits, the first query blocks' last one empty
    (4, 1, 64, 40_000, None), (8, 4, 300, 36_000, None),  # splits on the sm_90a path too
]


def _inputs(H: int, KVH: int, L: int, position: int, window: int | None, D: int = 256):
    n_prev = min(position, window - 1) if window else position
    key = mx.random.key(L * 7 + position)
    kq, kk, kv = mx.random.split(key, 3)
    q = mx.random.normal((1, H, L, D), key=kq).astype(mx.bfloat16)
    k = mx.random.normal((1, KVH, n_prev + L, D), key=kk).astype(mx.bfloat16)
    v = mx.random.normal((1, KVH, n_prev + L, D), key=kv).astype(mx.bfloat16)
    return q, k, v


def check(rec: Recorder, warps: int = 4, hopper: bool = False) -> bool:
    """The kernel against the unfused MLX path (`model.archs._attention.blocked_attention` in
    float32 on the same bf16 inputs) at every shape of `CHECKS`: whole-prompt and
    chunk-at-an-offset causal attention, sliding windows, GQA groups of 1 and 4, lengths that
    are not block multiples; max |difference| over max |reference| within `BF16_TOLERANCE`.
    `hopper`: the sm_90a path (`model.kernels.flash_attention_sm90`; `warps` then unused).
    """
    ok = True
    for H, KVH, L, position, window in CHECKS:
        q, k, v = _inputs(H, KVH, L, position, window)
        scale = 256 ** -0.5
        ours = flash_attention(q, k, v, scale, position, window, warps=warps,
                               hopper=hopper).astype(mx.float32)
        grouped = [x.astype(mx.float32) for x in (q, k, v)]
        if KVH != H:
            grouped[1] = mx.repeat(grouped[1], H // KVH, axis=1)
            grouped[2] = mx.repeat(grouped[2], H // KVH, axis=1)
        ref = blocked_attention(*grouped, scale, position, window)
        diff = float(mx.abs(ours - ref).max() / mx.abs(ref).max())
        ok &= diff <= BF16_TOLERANCE and not mx.isnan(ours).any().item()
        grid = plan(1, H, L, k.shape[2], window, warps=warps, hopper=hopper)
        rec("flash_attention_check", diff, "max|diff|/max|ref|", ceiling=BF16_TOLERANCE,
            heads=H, kv_heads=KVH, queries=L, position=position, window=window,
            **_path(warps, hopper), splits=grid.splits, block_warps=grid.warps)
    return ok


def _path(warps: int, hopper: bool) -> dict:
    """A record's fields naming the kernel path it measured."""
    if hopper:
        return {"path": "sm90 wgmma" + (" tma" if sm90.TMA else "")}
    return {"path": "mma.sync", "warps": warps}


def _seconds(fn, repeats: int = 5) -> float:
    """Fastest wall seconds of `repeats` evaluations of `fn()` after a warm-up one, the
    device synchronized around each (the host's graph building and launch included)."""
    mx.eval(fn())
    best = float("inf")
    for _ in range(repeats):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def _interleaved_seconds(fns: dict, rounds: int = 5, batch: int = 10) -> dict:
    """Seconds a call of each of `fns` (name -> a function returning an array) takes on the
    GPU: `batch` calls' graphs built first, then evaluated together (the launches queue
    behind each other, so the host's building and launching is off the clock), once per
    round for every function in turn (a clock that drifts over the run touches all alike);
    the fastest round, over `batch`."""
    for fn in fns.values():
        mx.eval(fn())
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            outs = [fn() for _ in range(batch)]
            mx.synchronize()
            t0 = time.perf_counter()
            mx.eval(outs)
            mx.synchronize()
            best[name] = min(best[name], (time.perf_counter() - t0) / batch)
    return best


def micro(rec: Recorder, peers: Iterable[dict] = (),
          shapes=((32, 4), (64, 4), (64, 8)), hopper: bool = False) -> None:
    """`MICRO` at each of its lengths; `shapes`: the kernel's (block_n, warps) to time;
    `peers`: the records `bench.gpu_peers.run_all` returned, for the ratios over torch.

    One global layer's causal attention (`MICRO`: 4 query heads of 256, 1 KV head, 8K and 32K
    queries), ours and MLX SDPA, timed in turn (`_interleaved_seconds` at `MICRO`'s repeats
    and batch; torch's children time its batches alike), as TFLOP/s of the causal work
    (`bench.common.causal_attention_flops`), each over torch SDPA's best backend at the same
    shape (``over_torch_sdpa``), which torch measures first in processes of its own;
    `hopper`: the sm_90a path too.
    """
    for L in MICRO["queries"]:
        _micro_at(rec, L, shapes, peers, hopper)


def _micro_at(rec: Recorder, L: int, shapes, peers: Iterable[dict], hopper: bool) -> None:
    H, D = MICRO["heads"], MICRO["head_dim"]
    q, k, v = _inputs(H, MICRO["kv_heads"], L, 0, None, D)
    flops = causal_attention_flops(L, H, D)
    runs = {("mma.sync", b, w): functools.partial(flash_attention, q, k, v, D ** -0.5, 0, None,
                                                  b, w, hopper=False) for b, w in shapes}
    if hopper:
        runs["sm90 wgmma", SM90_BLOCK_N, SM90_WARPS] = functools.partial(
            flash_attention, q, k, v, D ** -0.5, 0, None, hopper=True)
    seconds = _interleaved_seconds(runs, MICRO["repeats"], MICRO["batch"])
    for (path, block_n, warps), s in seconds.items():
        tflops = flops / s / 1e12
        rec("attention_tflops", tflops, "TFLOP/s", impl="prefillq fused", block_n=block_n,
            warps=warps, queries=L, seconds=round(s, 6), batch=MICRO["batch"], path=path,
            **attention_ratios(tflops, L, peers))
    # MLX's unfused path for 256-wide heads writes every score (8 GB at 32K): one call a
    # sample, its ms dwarfing the launch
    sdpa = functools.partial(mx.fast.scaled_dot_product_attention, q, k, v, scale=D ** -0.5,
                             mask="causal")
    s = _interleaved_seconds({"mlx sdpa": sdpa}, MICRO["repeats"], batch=1)["mlx sdpa"]
    rec("attention_tflops", flops / s / 1e12, "TFLOP/s", impl="mlx sdpa", queries=L,
        seconds=round(s, 6), batch=1, **attention_ratios(flops / s / 1e12, L, peers))


# The sm_90a kernel's build choices `sweep` times: (warpgroups, K/V stages, keys a step,
# ping-pong, TMA). One warpgroup's 32-key tiles (97 KB) let two blocks share a
# multiprocessor with two stages each; two warpgroups may take turns at the tensor cores
# within a step; a producer warpgroup may bring the tiles by the bulk tensor copy engine.
SM90_VARIANTS = ((2, 2, 64, False, False), (2, 1, 64, False, False), (1, 2, 64, False, False),
                 (1, 1, 64, False, False), (1, 2, 32, False, False), (2, 2, 32, False, False),
                 (2, 2, 64, True, False), (2, 1, 64, True, False), (2, 2, 32, True, False),
                 (2, 2, 64, True, True), (2, 2, 64, False, True))


def sweep(rec: Recorder, variants=SM90_VARIANTS) -> None:
    """Each of the sm_90a kernel's `variants` at `MICRO`'s shape, unsplit, timed in turn
    (`_interleaved_seconds`): TFLOP/s, and its output's max |difference| from the default
    build's over max |default| (the choices move only the schedule: 0 at 64 keys a step,
    the online softmax's rounding at 32)."""
    for L in MICRO["queries"]:
        _sweep_at(rec, L, variants)


def _sweep_at(rec: Recorder, L: int, variants) -> None:
    H, D = MICRO["heads"], MICRO["head_dim"]
    q, k, v = _inputs(H, MICRO["kv_heads"], L, 0, None, D)
    flops = causal_attention_flops(L, H, D)
    params = mx.array([0, 0, 0, L, L, 1], dtype=mx.int32)
    scale = mx.array([D ** -0.5], dtype=mx.float32)

    def run(wg: int, stages: int, block_n: int, pingpong: bool, tma: bool) -> mx.array:
        return sm90.launch(sm90.ONE, q, k, v, params, scale, -(-L // (64 * wg)), 1,
                           [q.shape], [q.dtype], block_n=block_n, warpgroups=wg,
                           stages=stages, pingpong=pingpong, tma=tma)[0]

    base = run(sm90.WARPGROUPS, sm90.STAGES, sm90.BLOCK_N, sm90.PINGPONG,
               sm90.TMA).astype(mx.float32)
    seconds = _interleaved_seconds({b: functools.partial(run, *b) for b in variants},
                                   MICRO["repeats"], MICRO["batch"])
    for build, s in seconds.items():
        diff = float(mx.abs(run(*build).astype(mx.float32) - base).max() / mx.abs(base).max())
        wg, stages, block_n, pingpong, tma = build
        rec("sm90_variant_tflops", flops / s / 1e12, "TFLOP/s", warpgroups=wg,
            stages=stages, block_n=block_n, pingpong=pingpong, tma=tma, queries=L,
            seconds=round(s, 6), diff_from_default=diff)


# Gemma 3's chunk shapes (H, KVH, L, position, window) at which `sweep_plan` times the
# sm_90a grids: 4B's 8 heads over 4 (global, and its 1,024 window), 270M's 4 over 1 (global,
# and its 512 window), 2,048- and 8,192-token chunks, and one 32K pass; then short chunks
# after 16K and 64K keys (a prompt's last chunk, a session's turn), grids of 4 to 64 blocks.
PLAN_SHAPES = (
    [(8, 4, 2048, p, None) for p in (0, 2048, 6144, 14_336, 30_720)]
    + [(8, 4, 2048, 6144, 1024)]
    + [(4, 1, 2048, p, None) for p in (0, 2048, 6144, 14_336, 30_720)]
    + [(4, 1, 2048, 6144, 512), (4, 1, 8192, 0, None), (4, 1, 8192, 24_576, None),
       (4, 1, 32_768, 0, None)]
    + [(8, 4, L, 16_384, None) for L in (1024, 512, 256)]
    + [(4, 1, L, 16_384, None) for L in (1024, 512, 64)]
    + [(8, 4, 512, 65_536, None), (4, 1, 512, 65_536, None), (4, 1, 64, 65_536, None)])


def sweep_plan(rec: Recorder, shapes=PLAN_SHAPES) -> None:
    """The sm_90a kernel at each of `shapes` on every grid `swept_grids` lists, the splits'
    combine included, timed in turn (`_interleaved_seconds`): ``sm90_grid_us`` each, with
    its output's max |difference| from the plan's over max |plan's| (only the schedule
    differs); then per shape the grid `plan` chooses against the earlier plan's (two
    warpgroups, splits up to one block per multiprocessor) and the fastest:
    ``sm90_plan_over_earlier``, ``sm90_plan_over_fastest`` (time ratios, > 1 when the plan
    is faster)."""
    for shape in shapes:
        _sweep_plan_at(rec, *shape)


def _sweep_plan_at(rec: Recorder, H: int, KVH: int, L: int, position: int,
                   window: int | None) -> None:
    q, k, v = _inputs(H, KVH, L, position, window)
    N = k.shape[2]
    shape = {"heads": H, "kv_heads": KVH, "queries": L, "position": position, "window": window}
    chosen = SweptGrid(*plan(1, H, L, N, window, hopper=True))
    base = _sm90_grid(q, k, v, position, window, chosen).astype(mx.float32)
    times = _interleaved_seconds({g: functools.partial(_sm90_grid, q, k, v, position, window, g)
                                  for g in swept_grids(H, L, N, window)})
    for grid, seconds in times.items():
        out = _sm90_grid(q, k, v, position, window, grid).astype(mx.float32)
        rec("sm90_grid_us", seconds * 1e6, "us", **shape, q_blocks=grid.q_blocks,
            splits=grid.splits, warpgroups=grid.warps // 4, block_n=grid.block_n,
            pingpong=grid.pingpong,
            diff_from_plan=float(mx.abs(out - base).max() / mx.abs(base).max()))
    earlier = SweptGrid(*earlier_plan(H, L, N, window))
    fastest = min(times, key=times.get)
    for name, than in (("earlier", earlier), ("fastest", fastest)):
        if chosen in times and than in times:
            rec(f"sm90_plan_over_{name}", times[than] / times[chosen], "x", **shape,
                plan=list(chosen), **{name: list(than)})


class SweptGrid(NamedTuple):
    """A grid `sweep_plan` times: `flash_attention.GridPlan`'s three, and the build."""

    q_blocks: int
    splits: int
    warps: int
    block_n: int = SM90_BLOCK_N
    pingpong: bool = sm90.PINGPONG


def swept_grids(H: int, L: int, N: int, window: int | None) -> list[SweptGrid]:
    """The grids `sweep_plan` times for `L` queries of `H` heads over `N` keys: two or one
    warpgroups, 1-8 splits of at least `MIN_KEY_BLOCKS_PER_SPLIT` of the key blocks a
    two-warpgroup block sees and the splits `plan` and `earlier_plan` take, 64 keys a
    step; with the fewest two splits also one warpgroup's 32-key steps (two blocks a
    multiprocessor with two K/V stages each) and two warpgroups taking turns or not."""
    visible = block_keys(N, window, 128)
    planned = {fa.sm90_plan(1, H, L, N, window).splits, earlier_plan(H, L, N, window)[1]}
    splits = sorted({s for s in (1, 2, 3, 4, 5, 6, 8)
                     if s == 1 or visible // SM90_BLOCK_N // s >= MIN_KEY_BLOCKS_PER_SPLIT}
                    | planned)
    two, one = -(-L // 128), -(-L // 64)
    return ([SweptGrid(q_blocks, s, warps) for q_blocks, warps in ((two, 8), (one, 4))
             for s in splits]
            + [SweptGrid(one, s, 4, block_n=32) for s in splits[:2]]
            + [SweptGrid(two, s, 8, pingpong=not sm90.PINGPONG) for s in splits[:2]])


def earlier_plan(H: int, L: int, N: int, window: int | None) -> tuple[int, int, int]:
    """The sm_90a grid before `sm90_plan`: two warpgroups, keys split until the grid
    reaches one block per multiprocessor (`grid_plan` at the sm_90a block)."""
    return tuple(grid_plan(1, H, L, N, window, SM90_BLOCK_N, SM90_WARPS, sm90.MULTIPROCESSORS))


def _sm90_grid(q, k, v, position: int, window: int | None, grid: SweptGrid) -> mx.array:
    """`flash_attention`'s sm_90a launch on `grid`."""
    launch = functools.partial(sm90.launch, block_n=grid.block_n, pingpong=grid.pingpong)
    with patched(fa, "plan", lambda *args, **kwargs: fa.GridPlan(*grid[:3])), \
            patched(sm90, "launch", launch):
        return flash_attention(q, k, v, q.shape[3] ** -0.5, position, window, hopper=True)


# Packed steps (`packed_flash_attention`): (H, KVH, jobs as (rows, position), window): one
# job, jobs shorter than a block, lengths off the block size, a window; then later chunks
# beside first ones, with the keys a cache returns (a window's last rows, or every row).
PACKED_CHECKS = [
    (4, 1, ((300, 0),), None), (4, 1, ((1, 0), (17, 0), (64, 0), (65, 0), (300, 0), (511, 0)),
                                None),
    (4, 1, ((1000, 0), (33, 0), (700, 0)), 512), (8, 2, ((129, 0), (2048, 0), (5, 0)), 1024),
    (4, 1, ((40, 0), (5, 300), (200, 2048), (64, 0)), 512),
    (4, 1, ((40, 0), (5, 300), (200, 2048), (64, 0)), None),
    (8, 2, ((17, 700), (256, 0), (1, 4095)), None), (8, 2, ((17, 700), (1, 4095)), 1024),
]


def check_packed(rec: Recorder, warps: int = 4, hopper: bool = False) -> bool:
    """`packed_flash_attention` against `flash_attention` of each job's rows alone at its
    position over its own keys (itself checked by `check`), at every case of
    `PACKED_CHECKS`: max |difference| over max |reference| within `BF16_TOLERANCE`."""
    ok = True
    for H, KVH, chunks, window in PACKED_CHECKS:
        scale = 256 ** -0.5
        alone = [_inputs(H, KVH, rows, position, window) for rows, position in chunks]
        jobs = [PackedJob(q.shape[2], k.shape[2], position)
                for (q, k, _), (_, position) in zip(alone, chunks, strict=True)]
        q, k, v = (mx.concatenate([a[i] for a in alone], axis=2) for i in range(3))
        ours = packed_flash_attention(q, k, v, scale, jobs, window, warps=warps,
                                      hopper=hopper)
        ref = mx.concatenate([flash_attention(q_i, k_i, v_i, scale, position, window,
                                              hopper=False)
                              for (q_i, k_i, v_i), (_, position) in zip(alone, chunks,
                                                                       strict=True)],
                             axis=2).astype(mx.float32)
        diff = float(mx.abs(ours.astype(mx.float32) - ref).max() / mx.abs(ref).max())
        ok &= diff <= BF16_TOLERANCE and not mx.isnan(ours).any().item()
        rec("packed_flash_attention_check", diff, "max|diff|/max|ref|",
            ceiling=BF16_TOLERANCE, heads=H, kv_heads=KVH, jobs=[list(j) for j in jobs],
            window=window, **_path(warps, hopper))
    return ok


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("python -m bench.gpu_attention", __doc__, json_lines=False)
    p.add_argument("--check", action="store_true",
                   help="the exactness checks without the micro-benchmark and its torch peers")
    p.add_argument("--sweep", action="store_true",
                   help="also time the sm_90a kernel's build variants (SM90_VARIANTS)")
    p.add_argument("--sweep-plan", action="store_true",
                   help="also time the sm_90a kernel's grids at Gemma 3's chunk shapes "
                        "(PLAN_SHAPES) against its plan")
    args = p.parse_args(argv)
    if not available():
        p.error(f"no CUDA GPU: MLX's default device is {mx.default_device()}")
    refuse_existing(p, args.out)
    rec = Recorder(True, {"date": datetime.date.today().isoformat(), "commit": git_commit(),
                          "device": str(mx.default_device()), "mlx": mx.__version__},
                   args.out, tags={"pid": os.getpid(), "process": p.prog})
    # torch's processes first, before this one has used the GPU
    peers = [] if args.check else run_all(rec, attention_plan(MICRO))
    ok = check(rec) and check(rec, warps=8) and check_packed(rec) and check_packed(rec, 8)
    hopper = sm90.compute_capability() == (9, 0)
    if hopper:  # the sm_90a path beside the mma.sync one
        ok &= check(rec, hopper=True) and check_packed(rec, hopper=True)
    log(f"flash attention check: {'ok' if ok else 'FAILED'}")
    if not args.check:
        micro(rec, peers, hopper=hopper)
    if args.sweep and hopper:
        sweep(rec)
    if args.sweep_plan and hopper:
        sweep_plan(rec)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
