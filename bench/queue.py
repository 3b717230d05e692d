"""Through the queue: a prefill job end to end, the queue's own cost per chunk, and how long
a short job waits behind a long one. A real redis-server (started here) and an in-process
worker."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from jobs import PrefillClient, PrefillResult
from model.registry import LoadedModel
from worker.embedded import embedded_queue, url_connections
from worker.redis_server import RedisServer
from worker.worker import PrefillWorker

from .common import Recorder, log, prompt_ids


def _queue(url: str, loaded: LoadedModel, **kwargs) -> tuple[PrefillWorker, PrefillClient]:
    queue = embedded_queue({loaded.name: loaded}, url_connections(url), name="bench", **kwargs)
    return queue.worker, queue.client()


@contextmanager
def queued_prefill(loaded: LoadedModel, top_k: int = 5, **worker_kwargs
                   ) -> Iterator[Callable[[list[int]], PrefillResult]]:
    """A callable that submits token ids to a fresh redis-server, runs the in-process worker
    (`PrefillWorker` with `worker_kwargs`) until the queue is empty (``work(burst=True)``)
    and returns the job's result. Its ``timings["prefill_s"]`` spans the job's first start
    to ``finished``: every chunk's RQ dequeue, cancel check, fenced checkpoint and
    continuation enqueue, then the final logits, top-k and publish; worker start-up and
    queue wait are outside it."""
    with RedisServer() as server:
        url = server.url
        worker, client = _queue(url, loaded, **worker_kwargs)

        def run(ids: list[int]) -> PrefillResult:
            job = client.submit(tokens=ids, model=loaded.name, top_k=top_k)
            worker.work(burst=True, logging_level="WARNING")
            return client.result(job, timeout=0)

        yield run


def queue_overhead_per_chunk(rec: Recorder, chunks: int = 64, chunk_tokens: int = 16,
                             repeats: int = 3) -> None:
    """Wall milliseconds per chunk that are not forward passes, on the tiny synthetic Gemma 3
    (so the forward is ~1 ms and the queue's own cost stands out): every chunk's RQ dequeue
    and bookkeeping, cancel check, fenced checkpoint and continuation enqueue, through a
    real redis-server. This is what a chunk costs beyond compute on a fast GPU."""
    from model.registry import load_model

    tiny = load_model("gemma3-tiny")
    ids = [i % tiny.vocab_size for i in range(chunks * chunk_tokens)]
    log(f"queue overhead per chunk: {chunks} chunks of {chunk_tokens} tokens, tiny model")
    per_chunk = []
    with queued_prefill(tiny, top_k=1, chunk_tokens=chunk_tokens) as submit_and_work:
        for _ in range(repeats + 1):  # the first run warms MLX and the scripts
            result = submit_and_work(ids)
            t = result.timings
            per_chunk.append((t["prefill_s"] - t["compute_s"]) / result.chunks_done)
    rec("queue_overhead_ms_per_chunk", min(per_chunk[1:]) * 1e3, "ms",
        chunks=result.chunks_done,
        chunk_tokens=chunk_tokens, model=tiny.name, repeats=repeats)


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
