"""python -m bench.prefix [--model gemma3-tiny] [--contexts 100] [--batch 1] [--rounds 1]
                         [--prefix-cache-bytes B] [--seed N] [--logs DIR] [--json] [--out FILE]

lm-eval-shaped multiple choice through the HTTP gateway, a worker's prefix cache off against
on (issue 27). Each of `--contexts` contexts of 200-800 tokens (BOS then random ids) gets 4
continuations of 3-20 tokens; every (context, continuation) is one loglikelihood request as
lm-evaluation-harness's ``local-completions`` sends it: ``POST /v1/completions`` with the
token ids, ``echo``, ``logprobs=1``, ``max_tokens=1``, `--batch` prompts a request in order
(lm-eval's ``batch_size``; its default 1 sends one prompt a request, one request after
another). Each arm runs a fresh ``prefillq worker`` (``--prefix-cache-bytes``: 0 or `--prefix-
cache-bytes`) and ``prefillq serve`` on a flushed redis-server; arms alternate over `--rounds`.
With `--batch` above 1 the gateway makes a request's prompts that share a prefix one job
(`jobs.gateway.shared`), in both arms; a third arm, ``separate``, sends each batch's prompts
at once as a request each (cache off), as the gateway answered a batch before it grouped
them, so the grouping's own gain is measured too.

Records (JSON lines): per arm and round ``prefix_mc_wall_s`` (first request to last
response), tokens submitted and reused (the responses' ``usage.prompt_tokens`` and
``prompt_tokens_details.cached_tokens``); then ``prefix_mc_computed_over_submitted`` (the
cache-on arm's prompt tokens computed over submitted, issue 27's ceiling 0.35),
``prefix_mc_speedup`` (cache-off wall time over cache-on, median over rounds; floor 2.5 on a
CPU), and ``prefix_mc_logprob_diff`` (the largest difference between the two arms' echoed
token logprobs, over the largest |logprob|) with the count of continuation tokens whose
greedy verdict (lm-eval's ``is_greedy``) differs; with ``separate``, the same two against
it (``prefix_mc_speedup`` ``over: separate``).
"""

from __future__ import annotations

import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import redis

from jobs import keys
from worker.redis_server import RedisServer, free_port

from .cache_arms import MODEL, add_arm_flags, alternate, log_bounds, served_name, vocab_size
from .common import Recorder, bench_parser, log, machine_context, refuse_existing
from .gateway import _spawn, _up, _wait
from .load import TOKEN_IDS

CONTEXT_TOKENS = (200, 800)
CONTINUATION_TOKENS = (3, 20)
CHOICES = 4
CEILING = 0.35  # issue 27: prompt tokens computed over submitted, cache on
CPU_FLOOR = 2.5  # issue 27: wall time cache off over cache on, on a CPU


@dataclass(frozen=True)
class ArmRun:
    """One arm's run: wall seconds, the tokens the responses report submitted and reused,
    and each prompt's echoed token logprobs (None for the first) and greedy verdicts."""

    name: str
    round: int
    wall_s: float
    submitted: int
    reused: int
    logprobs: list[list[float | None]]
    greedy: list[list[bool]]


def plan_requests(contexts: int, model: str, vocab_size: int, seed: int
                  ) -> tuple[list[list[int]], list[int]]:
    """The prompts in the order lm-eval sends them (each context's `CHOICES` continuations
    one after another) and each prompt's context length."""
    rng = random.Random(seed)
    lo, hi = TOKEN_IDS if model == MODEL else (3, vocab_size)
    prompts, context_lengths = [], []
    for _ in range(contexts):
        context = [2, *(rng.randrange(lo, hi) for _ in range(rng.randint(*CONTEXT_TOKENS) - 1))]
        for _ in range(CHOICES):
            n = rng.randint(*CONTINUATION_TOKENS)
            prompts.append(context + [rng.randrange(lo, hi) for _ in range(n)])
            context_lengths.append(len(context))
    return prompts, context_lengths


def score(http: httpx.Client, model: str, prompts: list[list[int]], batch: int,
          separate: bool = False) -> tuple[int, int, list[dict]]:
    """Send `prompts` `batch` a request, one request after another (`separate`: each batch's
    prompts at once, a request each); the prompt tokens and cached tokens the responses
    report, and every choice's ``logprobs`` in prompt order."""
    submitted = reused = 0
    choices = []

    def post(group: list[list[int]]) -> dict:
        response = http.post("/v1/completions", json={
            "model": model, "prompt": group, "max_tokens": 1, "temperature": 0, "echo": True,
            "logprobs": 1})
        response.raise_for_status()
        return response.json()

    with ThreadPoolExecutor(batch) as pool:
        for start in range(0, len(prompts), batch):
            group = prompts[start : start + batch]
            bodies = list(pool.map(post, [[p] for p in group])) if separate else [post(group)]
            for body in bodies:
                submitted += body["usage"]["prompt_tokens"]
                reused += body["usage"]["prompt_tokens_details"]["cached_tokens"]
                choices += [c["logprobs"]
                            for c in sorted(body["choices"], key=lambda c: c["index"])]
    return submitted, reused, choices


def greedy_verdicts(choice: dict, n_context: int) -> list[bool]:
    """lm-eval's ``is_greedy`` per continuation token: its logprob is the best
    alternative's (``top_logprobs``) at that position."""
    values, tops = choice["token_logprobs"], choice["top_logprobs"]
    n_prompt = len(choice["tokens"]) - 1  # echo plus the one generated token
    return [values[i] >= max(tops[i].values()) for i in range(n_context, n_prompt)]


def run_arm(server: RedisServer, name: str, round_: int, model: str, cache_bytes: int,
            prompts: list[list[int]], context_lengths: list[int], batch: int, logs: Path
            ) -> ArmRun:
    """A fresh worker (``--prefix-cache-bytes cache_bytes``) and gateway on a flushed Redis,
    a warm-up request, then every prompt timed."""
    redis.Redis.from_url(server.url).flushall()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    worker = f"p-{name}-{round_}"
    served = served_name(model)
    procs = [_spawn(["worker", "--redis", server.url, "--name", worker, "--model", model,
                     "--prefix-cache-bytes", str(cache_bytes)], logs / f"{worker}.log"),
             _spawn(["serve", "--redis", server.url, "--port", str(port), "--log-level",
                     "warning"], logs / f"gateway-{name}-{round_}.log")]
    try:
        conn = redis.Redis.from_url(server.url)
        _wait(lambda: conn.exists(keys.worker_heartbeat(worker)), 300, "the worker")
        _wait(lambda: _up(url), 60, "the gateway")
        with httpx.Client(base_url=url, timeout=3600) as http:
            # the tokenizer, MLX's kernels; a prompt no context starts with, so the measured
            # requests find nothing of theirs held
            score(http, served, [prompts[0][:1] + prompts[0][40:0:-1]], 1)
            t0 = time.perf_counter()
            submitted, reused, choices = score(http, served, prompts, batch,
                                               separate=name == "separate")
            wall_s = time.perf_counter() - t0
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=60)
    log(f"prefix: round {round_} {name}: {wall_s:.1f} s, {reused}/{submitted} tokens reused")
    return ArmRun(name, round_, wall_s, submitted, reused,
                  [c["token_logprobs"] for c in choices],
                  [greedy_verdicts(c, n) for c, n in zip(choices, context_lengths, strict=True)])


def report(rec: Recorder, runs: list[ArmRun], on_cpu: bool) -> None:
    """The records the module docstring lists, from alternating runs of ``off`` and ``on``
    (and ``separate``)."""
    for run in runs:
        rec("prefix_mc_wall_s", run.wall_s, "s", arm=run.name, round=run.round,
            prompt_tokens=run.submitted, cached_tokens=run.reused,
            computed_over_submitted=round(1 - run.reused / run.submitted, 4))
    off = [r for r in runs if r.name == "off"]
    on = [r for r in runs if r.name == "on"]
    on_ratio = statistics.median(1 - r.reused / r.submitted for r in on)
    rec("prefix_mc_computed_over_submitted", on_ratio, "ratio", ceiling=CEILING,
        how="prompt tokens computed over submitted with the prefix cache on: usage's "
            "prompt_tokens minus prompt_tokens_details.cached_tokens, median over rounds")
    # The floor is against sharing nothing: the cache-off arm with one prompt a request,
    # or, when requests carry several prompts (which the gateway then shares), `separate`.
    separate = [r for r in runs if r.name == "separate"]
    floor = {"floor": CPU_FLOOR} if on_cpu else {}
    per_round = [a.wall_s / b.wall_s for a, b in zip(off, on, strict=True)]
    rec("prefix_mc_speedup", statistics.median(per_round), "ratio",
        **({} if separate else floor), per_round=[round(x, 3) for x in per_round],
        how="wall time with the prefix cache off over on, the same requests, median of the "
            "rounds' ratios")
    for arm in (off, on) if separate else ():
        ratios = [s.wall_s / r.wall_s for s, r in zip(separate, arm, strict=True)]
        rec("prefix_mc_speedup", statistics.median(ratios), "ratio", over="separate",
            arm=arm[0].name, **(floor if arm is on else {}),
            per_round=[round(x, 3) for x in ratios],
            how="wall time of each batch's prompts sent as a request each (cache off) over "
                "this arm's batched requests, median of the rounds' ratios")
    a = np.array([x for p in off[0].logprobs for x in p[1:-1]], dtype=np.float64)
    b = np.array([x for p in on[0].logprobs for x in p[1:-1]], dtype=np.float64)
    mismatched = sum(x != y for p, q in zip(off[0].greedy, on[0].greedy, strict=True)
                     for x, y in zip(p, q, strict=True))
    rec("prefix_mc_logprob_diff", float(np.abs(a - b).max() / np.abs(a).max()), "ratio",
        greedy_mismatches=mismatched, greedy_checked=sum(map(len, off[0].greedy)),
        how="max |echoed token logprob, cache on - off| over max |logprob|, every prompt "
            "position of round 0; greedy verdicts of continuation tokens compared")


def build_parser():
    p = bench_parser("python -m bench.prefix", __doc__)
    p.add_argument("--contexts", type=int, default=100, help="contexts (default 100)")
    p.add_argument("--batch", type=int, default=1,
                   help="prompts a request, as lm-eval's batch_size (default 1)")
    add_arm_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    import mlx.core as mx

    p = build_parser()
    args = p.parse_args(argv)
    refuse_existing(p, args.out)
    prompts, context_lengths = plan_requests(args.contexts, args.model,
                                             vocab_size(args.model), args.seed)
    context = machine_context("prefix", redis=True) | {
        "model": args.model, "contexts": args.contexts, "choices": CHOICES,
        "context_tokens": CONTEXT_TOKENS, "continuation_tokens": CONTINUATION_TOKENS,
        "batch": args.batch, "rounds": args.rounds, "seed": args.seed,
        "prefix_cache_bytes": args.prefix_cache_bytes,
        "request": "POST /v1/completions, token ids, echo, logprobs=1, max_tokens=1"}
    rec = Recorder(args.json, context, args.out)
    runs = alternate(args, lambda server, name, round_, cache_bytes, logs: run_arm(
        server, name, round_, args.model, cache_bytes, prompts, context_lengths, args.batch,
        logs), extra=[("separate", 0)] if args.batch > 1 else [])
    report(rec, runs, on_cpu=mx.default_device() == mx.cpu)
    log_bounds(rec)
    return 0


if __name__ == "__main__":
    from model.runtime.blas import ensure_blas

    ensure_blas()
    raise SystemExit(main())
