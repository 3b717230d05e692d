"""python -m bench.gateway [--json] [--out FILE] [--model NAME]

What the HTTP gateway costs a request, measured side by side against the native client in
one run on one redis-server, one ``prefillq worker`` and one ``prefillq serve`` (`measure`).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from jobs import AsyncPrefillClient, PrefillClient, keys
from worker.redis_server import RedisServer, free_port

from .common import Recorder, bench_parser, log, machine_context, prompt_ids, refuse_existing

SCORING_TOKENS = 256
SHORT_TOKENS = 16
ROUNDS = 5
POLL_CONCURRENCY = 16
POLL_SECONDS = 3.0


def _spawn(args: list[str], log_path: Path) -> subprocess.Popen:
    out = open(log_path, "w")  # noqa: SIM115 (the child keeps it)
    return subprocess.Popen([sys.executable, "-m", "worker", *args], stdout=out,
                            stderr=subprocess.STDOUT)


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not start")
        time.sleep(0.2)


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


class Pair:
    """One request made both ways: through the gateway and through the native client."""

    def __init__(self, http: httpx.Client, native: PrefillClient, model: str,
                 ids: list[int], logprobs: bool):
        self.http, self.native, self.model, self.ids = http, native, model, ids
        self.logprobs = logprobs

    def through_http(self) -> float:
        body = {"model": self.model, "prompt": self.ids, "max_tokens": 1, "temperature": 0}
        if self.logprobs:
            body.update(echo=True, logprobs=1)
        t0 = time.perf_counter()
        response = self.http.post("/v1/completions", json=body)
        response.raise_for_status()
        response.json()
        return time.perf_counter() - t0

    def through_native(self) -> float:
        options = {"prompt_logprobs": 1} if self.logprobs else {}
        t0 = time.perf_counter()
        job = self.native.submit(tokens=self.ids, model=self.model, top_k=1, **options)
        self.native.result(job, timeout=600)
        return time.perf_counter() - t0

    def measure(self, rounds: int) -> tuple[float, float, list[float]]:
        """Best HTTP and native seconds over `rounds` rounds, which run the two in turn
        (alternating which goes first), and each round's native/HTTP ratio."""
        pairs = []
        for round_ in range(rounds):
            if round_ % 2 == 0:
                http_s = self.through_http()
                native_s = self.through_native()
            else:
                native_s = self.through_native()
                http_s = self.through_http()
            pairs.append((http_s, native_s))
        return (min(h for h, _ in pairs), min(n for _, n in pairs),
                [round(n / h, 4) for h, n in pairs])


async def _polls(poll, seconds: float, concurrency: int) -> float:
    """Calls of `poll()` completed per second by `concurrency` concurrent loops."""
    done = 0
    stop = time.perf_counter() + seconds

    async def loop() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await poll()
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done / (time.perf_counter() - t0)


async def _poll_rates(gateway_url: str, redis_url: str, job: str,
                      seconds: float) -> tuple[float, float]:
    limits = httpx.Limits(max_connections=POLL_CONCURRENCY)
    async with httpx.AsyncClient(base_url=gateway_url, limits=limits) as http:
        async def http_poll() -> None:
            (await http.get(f"/v1/prefill/{job}")).raise_for_status()

        over_http = await _polls(http_poll, seconds, POLL_CONCURRENCY)
    async with AsyncPrefillClient.from_url(redis_url) as native:
        async def native_poll() -> None:
            await native.status(job)

        direct = await _polls(native_poll, seconds, POLL_CONCURRENCY)
    return over_http, direct


def measure(rec: Recorder, model: str, rounds: int = ROUNDS, poll_seconds: float = POLL_SECONDS,
            ids: Callable[[int], list[int]] = prompt_ids) -> None:
    """Record, each timed from the request to the decoded response (`ids(n)`: a prompt of
    `n` token ids of `model`, default real Gemma 3 ids):

    - ``gateway_over_native``: lm-evaluation-harness's scoring request (``echo``,
      ``logprobs=1``, ``max_tokens=1`` over token ids) through ``POST /v1/completions``
      against the same job through `PrefillClient` (``submit(tokens, top_k=1,
      prompt_logprobs=1)`` then ``result``), alternating; the native seconds over the HTTP
      seconds, best of each (every pair's ratio in ``ratios``);
    - ``gateway_overhead_ms``: the same pair for a short plain prefill (no logprobs), whose
      difference is the gateway's fixed cost per request;
    - ``status_polls_per_s``: ``GET /v1/prefill/{id}`` of a finished job from concurrent
      keep-alive HTTP clients for a few seconds, and ``native_status_polls_per_s``: the
      asyncio client's ``status`` at the same concurrency."""
    with RedisServer() as server, tempfile.TemporaryDirectory() as logs:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        procs = [_spawn(["worker", "--redis", server.url, "--name", "b1", "--model", model],
                        Path(logs) / "worker.log"),
                 _spawn(["serve", "--redis", server.url, "--port", str(port),
                         "--log-level", "warning"], Path(logs) / "gateway.log")]
        try:
            native = PrefillClient.from_url(server.url)
            _wait(lambda: native.redis.exists(keys.worker_heartbeat("b1")), 300, "the worker")
            _wait(lambda: _up(url), 60, "the gateway")
            with httpx.Client(base_url=url, timeout=600) as http:
                scoring = Pair(http, native, model, ids(SCORING_TOKENS), logprobs=True)
                short = Pair(http, native, model, ids(SHORT_TOKENS), logprobs=False)
                for pair in (scoring, short):  # first requests load the tokenizer, warm MLX
                    pair.through_http(), pair.through_native()
                log(f"gateway: scoring {SCORING_TOKENS} tokens, {rounds} rounds each way")
                http_s, native_s, ratios = scoring.measure(rounds)
                log(f"gateway: a short prefill of {SHORT_TOKENS} tokens, {rounds * 2} rounds")
                short_http_s, short_native_s, _ = short.measure(rounds * 2)
            job = native.submit(tokens=ids(SHORT_TOKENS), model=model, top_k=1)
            native.result(job, timeout=600)
            log(f"gateway: status polls, {POLL_CONCURRENCY} concurrent, {poll_seconds} s")
            polls_http, polls_native = asyncio.run(
                _poll_rates(url, server.url, job, poll_seconds))
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=60)
    rec("gateway_over_native", native_s / http_s, "ratio", floor=0.95, model=model,
        n_tokens=SCORING_TOKENS, http_s=round(http_s, 4), native_s=round(native_s, 4),
        ratios=ratios, rounds=rounds,
        how="lm-eval's scoring request (echo, logprobs=1, max_tokens=1, token ids) through "
            "POST /v1/completions vs PrefillClient submit(prompt_logprobs=1)+result, "
            "alternating; best of each, request to decoded response")
    rec("gateway_overhead_ms", (short_http_s - short_native_s) * 1000, "ms", model=model,
        n_tokens=SHORT_TOKENS, http_s=round(short_http_s, 4),
        native_s=round(short_native_s, 4), rounds=rounds * 2,
        how="a plain prefill (top_k=1) through /v1/completions minus through PrefillClient, "
            "best of each, alternating")
    rec("status_polls_per_s", polls_http, "req/s", concurrency=POLL_CONCURRENCY,
        seconds=poll_seconds, how="GET /v1/prefill/{id} of a finished job, httpx keep-alive "
            "clients against one uvicorn process")
    rec("native_status_polls_per_s", polls_native, "calls/s", concurrency=POLL_CONCURRENCY,
        seconds=poll_seconds, how="AsyncPrefillClient.status of the same job, same concurrency")


def _context(model: str) -> dict:
    return machine_context("gateway") | {"model": model}


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("python -m bench.gateway", __doc__)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--rounds", type=int, default=ROUNDS)
    args = p.parse_args(argv)
    refuse_existing(p, args.out)
    rec = Recorder(args.json, _context(args.model), args.out)
    measure(rec, args.model, args.rounds)
    for line in rec.bounds_report():
        log(f"bench: {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
