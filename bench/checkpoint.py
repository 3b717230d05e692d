"""KV checkpoints: what writing them costs a prefill, and what they save when a worker dies."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jobs import JobState, PrefillClient, keys, protocol
from jobs.queues import enqueue_new
from model.registry import LoadedModel
from worker.checkpoints.policy import DEFAULT_CHECKPOINT_EVERY
from worker.redis_server import RedisServer

from .common import Recorder, log, prompt_ids
from .queue import queued_prefill

HEARTBEAT_TTL_S = 2


def checkpoint_overhead(rec: Recorder, loaded: LoadedModel, n: int = 8192,
                        repeats: int = 1, ids: list[int] | None = None) -> None:
    """Record ``checkpoint_overhead``: tokens/s with checkpoints every
    `DEFAULT_CHECKPOINT_EVERY` over tokens/s without (fastest of `repeats` each), one prompt
    through a real redis-server and an in-process worker, alternating; each side's tokens/s
    is the job's own ``prefill_s``. `ids`: the prompt (default: `n` real Gemma 3 ids)."""
    ids = ids or prompt_ids(n)
    n = len(ids)
    log(f"checkpoint overhead: {n} tokens, every {DEFAULT_CHECKPOINT_EVERY} vs none")
    seconds: dict[str, list[float]] = {"with": [], "without": []}
    written = 0
    with queued_prefill(loaded, top_k=1) as with_ckpt, \
            queued_prefill(loaded, top_k=1, checkpoint_every="none") as without:
        for r in range(repeats):
            order = ("with", "without") if r % 2 == 0 else ("without", "with")
            for side in order:
                queued = with_ckpt if side == "with" else without
                seconds[side].append(queued(ids).timings["prefill_s"])
        written = with_ckpt.worker.checkpointing.writer.written
    fast = {side: min(s) for side, s in seconds.items()}
    rec("checkpoint_overhead", fast["without"] / fast["with"], "ratio", floor=0.95, n_tokens=n,
        every=DEFAULT_CHECKPOINT_EVERY, checkpoints_written=written, repeats=repeats,
        with_tok_s=round(n / fast["with"], 1), without_tok_s=round(n / fast["without"], 1),
        model=loaded.name, how="queued prefill_s, alternating, fastest of each; "
                                "checkpoints in the queue's own Redis")


def resume_saving(rec: Recorder, model: str = "gemma3-270m", n: int = 8192,
                  chunk_tokens: int = 512, kill_at: float = 0.75,
                  ids: list[int] | None = None) -> None:
    """Record ``resume_saving``: two ``prefillq worker`` processes on one redis-server. A job
    routed to the first is SIGKILLed half a chunk after it has prefilled `kill_at` of its
    tokens (a death lands inside a chunk); the second finds it (heartbeat TTL 2 s), restores
    its latest checkpoint and finishes. The record is the seconds from the kill to
    ``finished`` over the cold run's (submit to ``finished``, the same prompt on the second
    worker first, uninterrupted). Each worker runs one short job first, unmeasured.

    The saving depends on how much
    was computed since the last checkpoint: with a checkpoint after every chunk (512-token
    CPU chunks take over the default 2 s) that is at most one chunk, 1/16 of this prompt.
    `ids`: the prompt (default: `n` real Gemma 3 ids)."""
    ids = ids or prompt_ids(n)
    n = len(ids)
    log(f"resume saving: {n} tokens in {chunk_tokens}-token chunks, SIGKILL at {kill_at:.0%}")
    with RedisServer() as server, tempfile.TemporaryDirectory() as logs:
        procs = {name: _worker(server.url, name, model, chunk_tokens, Path(logs))
                 for name in ("w1", "w2")}
        try:
            client = PrefillClient.from_url(server.url)
            for name in procs:
                _wait(lambda name=name: client.redis.exists(keys.worker_heartbeat(name)), 300)
            for name in procs:  # a first job is slower (allocations, kernels): not measured
                client.result(_routed(client, ids[:chunk_tokens], model, name), timeout=600)
            t0 = time.monotonic()
            cold = _routed(client, ids, model, "w2")
            client.result(cold, timeout=3600)
            cold_s = time.monotonic() - t0
            job = _routed(client, ids, model, "w1")
            started = time.monotonic()
            _wait(lambda: client.status(job).cursor >= kill_at * n, 3600)
            time.sleep(cold_s * chunk_tokens / n / 2)  # into the next chunk, as deaths land
            procs["w1"].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            at = client.status(job).cursor
            client.result(job, timeout=3600)
            resume_s = time.monotonic() - killed
            status = client.status(job)
        finally:
            for proc in procs.values():
                proc.kill()
                proc.wait()
        notes = [line for name in procs for line in (Path(logs) / f"{name}.log").read_text()
                 .splitlines() if "checkpoint" in line and job in line or "skipped" in line]
    assert status.state == JobState.FINISHED and status.worker == "w2", status
    rec("resume_saving", resume_s / cold_s, "ratio", ceiling=0.4, n_tokens=n,
        chunk_tokens=chunk_tokens, killed_after_s=round(killed - started, 2),
        cursor_at_kill=at, resumed_from=status.resumed_from, resume_s=round(resume_s, 2),
        cold_s=round(cold_s, 2), heartbeat_ttl_s=HEARTBEAT_TTL_S,
        every=DEFAULT_CHECKPOINT_EVERY, model=model, checkpoint_log=notes[-6:],
        how="two worker processes; SIGKILL half a chunk after 75% of the tokens; kill to "
            "finished over a cold run's submit to finished")


def _worker(url: str, name: str, model: str, chunk_tokens: int, logs: Path):
    out = open(logs / f"{name}.log", "w")  # noqa: SIM115 (the child keeps it)
    return subprocess.Popen(
        [sys.executable, "-m", "worker", "worker", "--redis", url, "--name", name,
         "--model", model, "--chunk-tokens", str(chunk_tokens),
         "--heartbeat-ttl", str(HEARTBEAT_TTL_S)],
        stdout=out, stderr=subprocess.STDOUT)


def _routed(client: PrefillClient, ids: list[int], model: str, worker: str) -> str:
    """Submit `ids` straight onto `worker`'s own queue (as a session's next job is routed),
    so only that worker starts it: `PrefillClient.submit` with the queue chosen here."""
    record = protocol.submitted_record(
        client.limits, prompt=None, tokens=ids, messages=None, model=model, top_k=1, logits="top_k",
        parse_special=True, session=None, priority=0, chunk_tokens=None,
        idempotency_key=None, max_attempts=3)
    with client.redis.pipeline() as pipe:
        pipe.multi()
        pipe.hset(keys.job(record.job_id), mapping=record.to_hash())
        enqueue_new(client.redis, record.job_id, model, 0, pipe, worker=worker)
        pipe.execute()
    return record.job_id


def _wait(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("a worker did not start")
        time.sleep(0.2)
