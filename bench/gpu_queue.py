"""The queue's cost on a GPU: a prefill through a real redis-server and an in-process worker
against the same prefill in process, side by side (bf16, Gemma 3 270M shapes, random weights).

    python -m bench.gpu_queue [--repeats N] [--out FILE]
"""

from __future__ import annotations

import contextlib
import datetime
import statistics
import time
from pathlib import Path

import mlx.core as mx

from model.registry import LoadedModel
from model.start import start_prefill
from worker.checkpoints.policy import DEFAULT_CHECKPOINT_EVERY

from .common import Recorder, bench_parser, git_commit, log, refuse_existing
from .gpu import GEMMA3_270M, gemma3_model
from .queue import queued_prefill

CASES = ((8192, 2048), (32_768, 2048))


def in_process_seconds(loaded: LoadedModel, ids: list[int], chunk: int) -> float:
    """Seconds of `Prefill.run` (every chunk and the final logits), timed from the same
    point as a job's ``prefill_s``: after the ids are checked and the cache is planned."""
    prefill = start_prefill(loaded.model, ids, vocab_size=loaded.vocab_size,
                            context_length=loaded.context_length, chunk_tokens=chunk,
                            kv_dtype=loaded.dtype)
    t0 = time.perf_counter()
    prefill.run()
    return time.perf_counter() - t0


def random_gemma3() -> LoadedModel:
    """Gemma 3 270M shapes with random bf16 weights, served under its own name."""
    return LoadedModel(
        name="gemma3-270m-shapes", architecture="gemma3", model=gemma3_model(),
        tokenizer=None,  # token-id jobs with top_k=0 never touch it
        context_length=GEMMA3_270M.context_length, vocab_size=GEMMA3_270M.vocab_size,
        dtype=mx.bfloat16, sha256="random-weights", path=Path("-"), load_seconds=0.0)


def queue_over_in_process(rec: Recorder, loaded: LoadedModel, n: int, chunk: int,
                          repeats: int) -> None:
    """Record ``gpu_queue_over_in_process``: the runs alternate (in process, queued, queued, in
    process, ...) and each side keeps its fastest; in process is `in_process_seconds`, queued
    the job's ``prefill_s`` (its first start to ``finished``: the rest of its one RQ execution,
    a round trip per chunk, the final logits; the publish's own round trip comes after). Jobs
    carry token ids and ask for no top-k, so the random-weight model needs no tokenizer.
    """
    ids = mx.random.randint(0, loaded.vocab_size, (n,)).tolist()
    with queued_prefill(loaded, top_k=0) as queued:
        in_process_seconds(loaded, ids, chunk)  # compile kernels, warm the allocator
        queued(ids, chunk_tokens=chunk)  # load the scripts
        sides: dict[str, list[float]] = {"in_process": [], "queued": []}
        for r in range(repeats):
            for side in ("in_process", "queued") if r % 2 == 0 else ("queued", "in_process"):
                if side == "in_process":
                    sides[side].append(in_process_seconds(loaded, ids, chunk))
                else:
                    sides[side].append(queued(ids, chunk_tokens=chunk).timings["prefill_s"])
    fast = {side: min(seconds) for side, seconds in sides.items()}
    middle = {side: statistics.median(seconds) for side, seconds in sides.items()}
    chunks = -(-n // chunk)
    rec("gpu_queue_over_in_process", fast["in_process"] / fast["queued"], "ratio", floor=0.95,
        n_tokens=n, chunk_tokens=chunk, chunks=chunks, repeats=repeats,
        in_process_tok_s=round(n / fast["in_process"]), queued_tok_s=round(n / fast["queued"]),
        queue_ms_per_chunk=round((fast["queued"] - fast["in_process"]) / chunks * 1e3, 3),
        median_ratio=round(middle["in_process"] / middle["queued"], 4),
        model="gemma3-270m shapes", dtype="bfloat16",
        how="alternating runs, fastest of each (and the medians' ratio); queued = the "
            "job's prefill_s")


def checkpoint_over_none(rec: Recorder, loaded: LoadedModel, n: int, chunk: int,
                         repeats: int) -> None:
    """``gpu_checkpoint_overhead``: a queued prefill's tokens/s with KV checkpoints (every
    ``--checkpoint-every`` default, and after every chunk, the worst case) over without,
    alternating runs, fastest of each."""
    ids = mx.random.randint(0, loaded.vocab_size, (n,)).tolist()
    sides = {"none": "none", "default": DEFAULT_CHECKPOINT_EVERY, "every_chunk": "1"}
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    with contextlib.ExitStack() as stack:
        queued = {side: stack.enter_context(queued_prefill(loaded, top_k=0,
                                                           checkpoint_every=every))
                  for side, every in sides.items()}
        for q in queued.values():
            q(ids, chunk_tokens=chunk)  # load the scripts, warm up
        for r in range(repeats):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for side in order:
                seconds[side].append(queued[side](ids, chunk_tokens=chunk).timings["prefill_s"])
        written = {side: q.worker.checkpointing.writer.written
                   for side, q in queued.items() if q.worker.checkpointing is not None}
    fast = {side: min(s) for side, s in seconds.items()}
    for side in ("default", "every_chunk"):
        rec("gpu_checkpoint_overhead", fast["none"] / fast[side], "ratio", floor=0.9,
            every=sides[side], n_tokens=n, chunk_tokens=chunk, repeats=repeats,
            checkpoints_written=written[side], tok_s=round(n / fast[side]),
            none_tok_s=round(n / fast["none"]), model="gemma3-270m shapes", dtype="bfloat16",
            how="queued prefill_s, alternating with no checkpoints, fastest of each; "
                "checkpoints in the bench's redis-server")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("python -m bench.gpu_queue", __doc__, json_lines=False)
    p.add_argument("--repeats", type=int, default=16,
                   help="runs per side (default %(default)s)")
    args = p.parse_args(argv)
    if mx.default_device() != mx.gpu:
        p.error(f"no GPU: MLX's default device is {mx.default_device()}")
    refuse_existing(p, args.out)
    context = {"date": datetime.date.today().isoformat(), "commit": git_commit(),
               "device": str(mx.default_device()), "mlx": mx.__version__}
    rec = Recorder(True, context, args.out)
    loaded = random_gemma3()
    for n, chunk in CASES:
        log(f"queue vs in process: {n} tokens in {chunk}-token chunks")
        queue_over_in_process(rec, loaded, n, chunk, args.repeats)
    n, chunk = CASES[-1]
    log(f"checkpoints vs none: {n} tokens in {chunk}-token chunks")
    checkpoint_over_none(rec, loaded, n, chunk, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
