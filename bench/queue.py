"""Through the queue: a prefill job end to end, the queue's own cost per chunk, and how long
a short job waits behind a long one. A real redis-server (started here) and an in-process
worker."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from jobs import PrefillClient, PrefillResult, stats
from model.registry import LoadedModel
from worker.embedded import embedded_queue, url_connections
from worker.redis_server import RedisServer, calls_since, command_calls
from worker.settings import WorkerSettings
from worker.worker import PrefillWorker

from .common import Recorder, log, prompt_ids


def _queue(url: str, loaded: LoadedModel, **settings) -> tuple[PrefillWorker, PrefillClient]:
    queue = embedded_queue({loaded.name: loaded}, url_connections(url), name="bench",
                           settings=WorkerSettings(publish_tokenizers=False, **settings))
    return queue.worker, queue.client()


@dataclass
class QueuedPrefill:
    """Submits token ids to its redis-server and runs the in-process worker until the queue
    is empty (``work(burst=True)``); calling it returns the job's result. Its
    ``timings["prefill_s"]`` spans the job's first start to ``finished``: the job's one RQ
    execution (admission), every chunk's round trip (fenced checkpoint, cancel flags, intake
    lengths), then the final logits, top-k and publish; worker start-up and queue wait are
    outside it."""

    worker: PrefillWorker
    client: PrefillClient
    model: str
    top_k: int

    @property
    def redis(self):
        return self.client.redis

    def __call__(self, ids: list[int], **submit_kwargs) -> PrefillResult:
        job = self.client.submit(tokens=ids, model=self.model, top_k=self.top_k,
                                 **submit_kwargs)
        self.worker.work(burst=True, logging_level="WARNING")
        return self.client.result(job, timeout=0)


@contextmanager
def queued_prefill(loaded: LoadedModel, top_k: int = 5, **worker_kwargs
                   ) -> Iterator[QueuedPrefill]:
    """A `QueuedPrefill` of `loaded` on a fresh redis-server (`WorkerSettings` fields in
    `worker_kwargs`)."""
    with RedisServer() as server:
        worker, client = _queue(server.url, loaded, **worker_kwargs)
        yield QueuedPrefill(worker, client, loaded.name, top_k)


def queue_overhead_per_chunk(rec: Recorder, chunks: int = 64, chunk_tokens: int = 16,
                             repeats: int = 3) -> None:
    """What the queue costs one chunk beyond its forward pass, on the tiny synthetic Gemma 3
    (its forward passes are short, so the queue's own cost stands out), through a real
    redis-server: the wall milliseconds per chunk outside forward passes (the job's fixed
    cost included, spread over its chunks), and the Redis commands one more chunk costs
    (``INFO commandstats`` of the same prompt in `chunks` and in `chunks` / 4 chunks,
    differenced, so the job's fixed cost cancels). This is what a chunk costs beyond
    compute on a fast GPU."""
    from model.registry import load_model

    tiny = load_model("gemma3-tiny")
    ids = [i % tiny.vocab_size for i in range(chunks * chunk_tokens)]
    log(f"queue overhead per chunk: {chunks} chunks of {chunk_tokens} tokens, tiny model")
    per_chunk = []
    # the worker heartbeats far apart: none of its beats lands inside a measured run
    with queued_prefill(tiny, top_k=1, heartbeat_ttl_s=3600) as queued:
        for _ in range(repeats + 1):  # the first run warms MLX and loads the scripts
            result = queued(ids, chunk_tokens=chunk_tokens)
            t = result.timings
            per_chunk.append((t["prefill_s"] - t["compute_s"]) / result.chunks_done)
        spent = [_commands(queued, ids, size) for size in (chunk_tokens, 4 * chunk_tokens)]
    rec("queue_overhead_ms_per_chunk", min(per_chunk[1:]) * 1e3, "ms", ceiling=1.0,
        chunks=result.chunks_done, chunk_tokens=chunk_tokens, model=tiny.name,
        repeats=repeats, how="min over repeats of (prefill_s - compute_s) / chunks")
    fewer = chunks - chunks // 4
    by_command = {k: round((spent[0].get(k, 0) - spent[1].get(k, 0)) / fewer, 3)
                  for k in spent[0] | spent[1]}
    rec("redis_commands_per_chunk", sum(by_command.values()), "commands",
        ceiling=6 + stats.COMMANDS_PER_CHUNK,
        by_command={k: v for k, v in by_command.items() if v}, chunks=(chunks, chunks // 4),
        model=tiny.name, how="INFO commandstats, same prompt in 64 vs 16 chunks, differenced")


def _commands(queued: QueuedPrefill, ids: list[int], chunk_tokens: int) -> dict[str, int]:
    before = command_calls(queued.redis)
    queued(ids, chunk_tokens=chunk_tokens)
    return calls_since(queued.redis, before)


def _latency(client: PrefillClient, job: str) -> float:
    status = client.status(job)
    return status.finished_at - status.enqueued_at


# When each short job arrives, as a fraction of the long job's chunk in progress.
ARRIVALS = (0.2, 0.5, 0.8)


def short_wait_over_chunk_time(rec: Recorder, loaded: LoadedModel, n_long: int,
                               chunk_tokens: int = 512, n_short: int = 64) -> None:
    """(short latency under a long prefill - short latency idle) / the long job's mean chunk
    time. Shorts arrive 20%, 50% and 80% into three of the long job's chunks."""
    log(f"short job under a {n_long}-token prefill in {chunk_tokens}-token chunks")
    short_ids = prompt_ids(n_short)
    with RedisServer() as server:
        url = server.url
        worker, client = _queue(url, loaded, chunk_tokens=chunk_tokens)
        idle = []
        for _ in ARRIVALS:
            job = client.submit(tokens=short_ids, model=loaded.name, top_k=1)
            worker.work(burst=True, logging_level="WARNING")
            idle.append(_latency(client, job))

        long_job = client.submit(tokens=prompt_ids(n_long), model=loaded.name, top_k=1)
        submitted: list[str] = []

        def submit_shorts() -> None:
            watcher, last = PrefillClient.from_url(url), None
            for status in watcher.watch(long_job, timeout=3600):
                if len(submitted) == len(ARRIVALS):
                    return
                if last is not None and status.chunks_done > last.chunks_done >= 0:
                    chunk_s = status.updated_at - last.updated_at
                    time.sleep(ARRIVALS[len(submitted)] * chunk_s)
                    submitted.append(
                        watcher.submit(tokens=short_ids, model=loaded.name, top_k=1))
                last = status

        thread = threading.Thread(target=submit_shorts, daemon=True)
        thread.start()
        worker.work(burst=True, logging_level="WARNING")
        thread.join(timeout=60)
        worker.work(burst=True, logging_level="WARNING")  # shorts that came after the last
        result = client.result(long_job, timeout=0)
        chunk_s = result.timings["compute_s"] / result.chunks_done
        under_load = [_latency(client, j) for j in submitted]
    mean_idle = sum(idle) / len(idle)
    waits = [(lat - mean_idle) / chunk_s for lat in under_load]
    rec("short_wait_over_chunk_time", sum(waits) / len(waits), "ratio",
        max_wait_chunks=round(max(waits), 3), shorts=len(waits), n_long=n_long,
        long_chunk_tokens=chunk_tokens, long_chunk_s=round(chunk_s, 3), n_short=n_short,
        idle_latency_s=round(mean_idle, 3), ceiling=1.5)
