"""A worker's prefix cache (``--prefix-cache-bytes``, `worker.prefixes`) on the tiny Gemma 3
through a real redis-server: a job that shares a prefix with one finished before starts from
its held blocks (``reuse`` ``prefix``, ``cached_tokens``) with the logits of a cold prefill,
and the prompt logprobs too where the blocks kept them; a worker without the cache runs as
before."""

from __future__ import annotations

import numpy as np

from jobs import JobState
from jobs.stats import read_cluster_stats_sync

from .helpers import MODEL, ids

# as tests/model/test_prefix_cache.py: a prefill from restored blocks against a cold one,
# max |diff| / max |logit| (measured up to 1.1e-6 on the tiny models)
REUSE_BOUND = 5e-6
BUDGET = 64 << 20


def _full_logits(client, job) -> np.ndarray:
    return np.asarray(client.result(job, timeout=0).logits, dtype=np.float32)


def _assert_cold_logits(logits: np.ndarray, tiny, token_ids) -> None:
    ref = tiny.start_prefill(token_ids).run()
    assert float(np.abs(logits - ref).max()) <= REUSE_BOUND * float(np.abs(ref).max())
    assert int(logits.argmax()) == int(ref.argmax())


def test_a_job_sharing_a_finished_jobs_prefix_starts_from_its_blocks(setup, tiny):
    worker, client = setup(prefix_cache_bytes=BUDGET, max_batch_jobs=1)
    context = ids(100, 1)  # 3 whole 32-token blocks
    first = client.submit(tokens=context + [300, 301], model=MODEL, logits="full")
    worker.work(burst=True)
    later = context[:80] + ids(40, 2)[1:]  # shares 2 whole blocks (64 tokens) and 16 more
    second = client.submit(tokens=later, model=MODEL, logits="full")
    worker.work(burst=True)
    cold, warm = client.status(first), client.status(second)
    assert (cold.state, cold.reuse, cold.cached_tokens) == (JobState.FINISHED, "cold", 0)
    assert (warm.state, warm.reuse, warm.cached_tokens) == (JobState.FINISHED, "prefix", 64)
    assert client.result(second, timeout=0).cached_tokens == 64
    assert warm.chunks_done == 4  # 119 - 64 = 55 tokens in chunks of 16
    _assert_cold_logits(_full_logits(client, second), tiny, later)
    assert (worker.prefixes.reused_jobs, worker.prefixes.reused_tokens) == (1, 64)
    stats = read_cluster_stats_sync(client.redis)  # what /metrics exports
    assert (stats.tokens_reused, stats.prefix_hits, stats.prefix_misses) == (64, 1, 1)
    assert stats.prefix_bytes == 0  # the burst ended: no live worker holds blocks
    worker.register_models()
    assert read_cluster_stats_sync(client.redis).prefix_bytes == worker.prefixes.cache.nbytes > 0


def test_prompt_logprobs_reuse_blocks_that_kept_them_with_a_cold_jobs_values(setup, tiny):
    worker, client = setup(prefix_cache_bytes=BUDGET, max_batch_jobs=1)
    context = ids(70, 3)  # 2 whole blocks
    client.submit(tokens=context, model=MODEL)
    worker.work(burst=True)
    first = client.submit(tokens=context + [300], model=MODEL, prompt_logprobs=2)
    worker.work(burst=True)  # the blocks kept no logprobs: cold, and it adds them
    assert (client.status(first).reuse, client.status(first).cached_tokens) == ("cold", 0)
    prompt = context + [301, 302]
    second = client.submit(tokens=prompt, model=MODEL, prompt_logprobs=2)
    worker.work(burst=True)
    assert (client.status(second).reuse, client.status(second).cached_tokens) == ("prefix", 64)
    got = client.result(second, timeout=0).prompt_logprobs
    cold = tiny.start_prefill(prompt, prompt_logprobs=2)
    cold.run()
    ref = cold.logprobs
    assert [e["token"] for e in got] == [*prompt, None]
    values = np.array([np.nan if e["logprob"] is None else e["logprob"] for e in got])
    scale = float(np.nanmax(np.abs(ref.token_logprob)))
    assert float(np.nanmax(np.abs(values - ref.token_logprob))) <= REUSE_BOUND * scale
    assert [[t["id"] for t in e["top"]] for e in got[1:]] == ref.top_ids[1:].tolist()


def test_a_worker_without_the_cache_runs_cold(setup, tiny):
    context = ids(70, 3)
    off, off_client = setup(name="w2")
    assert off.prefixes is None
    off_client.submit(tokens=context, model=MODEL)
    job = off_client.submit(tokens=context + [301], model=MODEL, logits="full")
    off.work(burst=True)
    assert off_client.status(job).reuse == "cold"
    _assert_cold_logits(_full_logits(off_client, job), tiny, context + [301])


def test_packed_steps_capture_and_reuse_prefixes_beside_other_jobs(setup, tiny):
    """Jobs that capture write their last chunk's rows in a packed step; the next wave
    reuses them, each job's logits those of a cold prefill."""
    worker, client = setup(prefix_cache_bytes=BUDGET, max_batch_jobs=4)
    contexts = [ids(64 + 10 * i, 10 + i) for i in range(3)]
    for context in contexts:
        client.submit(tokens=context, model=MODEL)
    worker.work(burst=True)
    prompts = [c[:64] + ids(20, 20 + i)[1:] for i, c in enumerate(contexts)]
    jobs = [client.submit(tokens=p, model=MODEL, logits="full") for p in prompts]
    worker.work(burst=True)
    for job, prompt in zip(jobs, prompts, strict=True):
        status = client.status(job)
        assert (status.reuse, status.cached_tokens) == ("prefix", 64)
        _assert_cold_logits(_full_logits(client, job), tiny, prompt)


def test_choices_submitted_together_wait_for_the_first_to_prefill_their_context(setup, tiny):
    """A multiple-choice question's four requests arrive at once (lm-eval's batches): the
    first computes the context, the others wait for it instead of computing it three more
    times, then start after its whole blocks; a job with another context runs beside it."""
    worker, client = setup(prefix_cache_bytes=BUDGET, max_batch_jobs=8, max_active=8)
    context = ids(100, 4)
    prompts = [context + ids(10, 30 + i)[1:] for i in range(4)]
    other = ids(90, 5)
    jobs = [client.submit(tokens=p, model=MODEL, logits="full") for p in prompts]
    lone = client.submit(tokens=other, model=MODEL)
    worker.work(burst=True)
    statuses = [client.status(j) for j in jobs]
    assert [(s.reuse, s.cached_tokens) for s in statuses] == [
        ("cold", 0), ("prefix", 96), ("prefix", 96), ("prefix", 96)]
    assert client.status(lone).state == JobState.FINISHED
    assert worker.prefixes.capturing == {}  # every capture ended with its job
    for job, prompt in zip(jobs, prompts, strict=True):
        _assert_cold_logits(_full_logits(client, job), tiny, prompt)


def test_a_deferred_job_starts_cold_when_the_job_it_waited_for_is_canceled(setup, tiny,
                                                                           on_chunk):
    worker, client = setup(prefix_cache_bytes=BUDGET, max_batch_jobs=1, max_active=4)
    context = ids(100, 6)
    first = client.submit(tokens=context + [300], model=MODEL)
    second = client.submit(tokens=context + [301], model=MODEL, logits="full")
    seen = []

    def cancel_the_first_after_its_second_chunk(job_id, chunk_no):
        if job_id == first and chunk_no == 2:
            seen.append(sorted(worker.active))  # the second waits for the first's blocks
            client.cancel(first)

    on_chunk(cancel_the_first_after_its_second_chunk)
    worker.work(burst=True)
    assert seen == [[first]]
    assert client.status(first).state == JobState.CANCELED
    status = client.status(second)
    assert (status.state, status.reuse, status.cached_tokens) == (JobState.FINISHED, "cold", 0)
    _assert_cold_logits(_full_logits(client, second), tiny, context + [301])


def test_a_job_defers_only_to_a_live_capturer_and_a_gone_one_gives_way(tiny):
    from worker.prefixes import PrefixBlocks

    blocks = PrefixBlocks(BUDGET)
    context = ids(100, 7)
    first = blocks.prefill(tiny, context + [300], job_id="a", chunk_tokens=None,
                           prompt_logprobs=None)
    assert first is not None and len(first[1]) == 3
    assert set(blocks.capturing.values()) == {"a"}
    later = context + [301]
    assert blocks.prefill(tiny, later, job_id="b", chunk_tokens=None, prompt_logprobs=None,
                          live=lambda job_id: job_id == "a") is None
    # "a" was never taken (or left): "b" starts cold and captures the blocks itself
    second = blocks.prefill(tiny, later, job_id="b", chunk_tokens=None, prompt_logprobs=None)
    assert second is not None and second[0].cached_tokens == 0
    assert blocks.capturing == dict.fromkeys(second[1], "b")
    blocks.release("b", second[1])
    assert blocks.capturing == {}


def test_submit_routes_a_job_to_the_live_worker_that_keeps_its_prefix(setup, tiny):
    from jobs import keys
    from jobs.queues import rq_queue_key

    w1, client = setup(name="w1", prefix_cache_bytes=BUDGET)
    w2, _ = setup(name="w2", prefix_cache_bytes=BUDGET)
    context = ids(200, 8)  # 6 whole blocks
    client.submit(tokens=context + [300], model=MODEL)
    w1.work(burst=True)
    assert client.redis.hget(keys.PREFIX_ROOTS, MODEL) == w1.prefixes.root(tiny).hex().encode()
    w1.register_models()  # alive again: a burst's end deregisters the worker
    later = client.submit(tokens=context[:150] + ids(30, 9)[1:], model=MODEL, logits="full")
    assert client.redis.llen(rq_queue_key(keys.own_queue("w1"))) == 1  # routed, not intake
    w2.work(burst=True)  # its queues hold nothing
    assert client.status(later).state == JobState.QUEUED
    w1.work(burst=True)
    status = client.status(later)
    assert (status.state, status.reuse, status.cached_tokens) == (JobState.FINISHED, "prefix", 128)
    _assert_cold_logits(_full_logits(client, later), tiny, context[:150] + ids(30, 9)[1:])
    # text prompts, other prefixes and a holder that is gone go to intake
    client.redis.delete(keys.worker_heartbeat("w1"))
    gone = client.submit(tokens=context + [301], model=MODEL)
    other = client.submit(tokens=ids(200, 10), model=MODEL)
    assert client.redis.llen(rq_queue_key(keys.own_queue("w1"))) == 0
    w2.work(burst=True)
    assert [client.status(j).reuse for j in (gone, other)] == ["cold", "cold"]


def test_jobs_share_blocks_only_with_their_own_cache_salt_and_are_routed_by_it(setup, tiny):
    from jobs import keys
    from jobs.queues import rq_queue_key

    worker, client = setup(prefix_cache_bytes=BUDGET, max_batch_jobs=1)
    context = ids(100, 11)
    client.submit(tokens=context + [300], model=MODEL, cache_salt="tenant-a")
    worker.work(burst=True)
    worker.register_models()  # alive again: a burst's end deregisters the worker
    jobs = {salt: client.submit(tokens=context + [301], model=MODEL, cache_salt=salt)
            for salt in (None, "tenant-b", "tenant-a")}
    # only tenant-a's job is routed to the holder of tenant-a's blocks (w1 is its name)
    assert client.redis.llen(rq_queue_key(keys.own_queue("w1"))) == 1
    worker.work(burst=True)
    reused = {salt: (client.status(j).reuse, client.status(j).cached_tokens)
              for salt, j in jobs.items()}
    assert reused == {None: ("cold", 0), "tenant-b": ("cold", 0), "tenant-a": ("prefix", 96)}


def test_a_holder_with_a_full_own_queue_gets_no_more_jobs(setup, tiny):
    from jobs import keys
    from jobs.prefixes import ROUTE_MAX_WAITING
    from jobs.queues import rq_queue_key

    worker, client = setup(prefix_cache_bytes=BUDGET)
    context = ids(100, 12)
    client.submit(tokens=context + [300], model=MODEL)
    worker.work(burst=True)
    worker.register_models()
    jobs = [client.submit(tokens=context + [301 + i], model=MODEL)
            for i in range(ROUTE_MAX_WAITING + 2)]
    own, intake = rq_queue_key(keys.own_queue("w1")), rq_queue_key(keys.intake_queue(MODEL))
    assert (client.redis.llen(own), client.redis.llen(intake)) == (ROUTE_MAX_WAITING, 2)
    worker.work(burst=True)
    assert all(client.status(j).state == JobState.FINISHED for j in jobs)


def test_a_worker_fetches_another_workers_blocks_from_the_shared_tier(setup, tiny):
    from jobs import keys

    w1, client = setup(name="w1", prefix_cache_bytes=BUDGET, prefix_store="redis")
    w2, _ = setup(name="w2", prefix_cache_bytes=BUDGET, prefix_store="redis")
    context = ids(100, 13)  # 3 whole blocks
    client.submit(tokens=context + [300], model=MODEL, prompt_logprobs=1)
    w1.work(burst=True)
    stored = [k for k in client.redis.keys(keys.PREFIX_BLOCK.format(key="*"))]
    assert len(stored) == 3  # w1 wrote the blocks it kept
    later = context[:90] + ids(20, 14)[1:]
    job = client.submit(tokens=later, model=MODEL, logits="full", prompt_logprobs=1)
    w2.work(burst=True)  # w1 is gone (a burst's end): the job went to intake
    status = client.status(job)
    assert (status.worker, status.reuse, status.cached_tokens) == ("w2", "prefix", 64)
    assert w2.prefixes.shared.fetched_tokens == 64 and w2.prefixes.shared.fetch_s_per_token
    _assert_cold_logits(_full_logits(client, job), tiny, later)
    cold = tiny.start_prefill(later, prompt_logprobs=1)
    cold.run()
    got = client.result(job, timeout=0).prompt_logprobs
    want = cold.logprobs.token_logprob[1 : len(later)]
    scale = float(np.nanmax(np.abs(want)))
    assert max(abs(e["logprob"] - w) for e, w in zip(got[1:-1], want, strict=True)) \
        <= REUSE_BOUND * scale


def test_the_shared_tier_is_not_fetched_from_while_computing_is_cheaper(setup, tiny):
    from jobs import keys

    w1, client = setup(name="w1", prefix_cache_bytes=BUDGET, prefix_store="redis")
    w2, _ = setup(name="w2", prefix_cache_bytes=BUDGET, prefix_store="redis")
    context = ids(100, 15)
    client.submit(tokens=context + [300], model=MODEL)
    w1.work(burst=True)
    w2.prefixes.shared.fetch_s_per_token = 1.0  # measured: a fetched token costs 1 s
    w2.prefixes.shared.compute_s_per_token = 1e-3
    slow = client.submit(tokens=context + [301], model=MODEL)
    w2.work(burst=True)
    assert client.status(slow).reuse == "cold" and w2.prefixes.shared.fetched_tokens == 0
    # a corrupt block in the store costs a cold prefill, never the job
    key = client.redis.keys(keys.PREFIX_BLOCK.format(key="*"))
    w3, _ = setup(name="w3", prefix_cache_bytes=BUDGET, prefix_store="redis")
    for k in key:
        client.redis.set(k, b"not msgpack")
    job = client.submit(tokens=context + [302], model=MODEL)
    w3.work(burst=True)
    status = client.status(job)
    assert (status.state, status.worker, status.reuse) == (JobState.FINISHED, "w3", "cold")


def test_a_reused_prefix_keeps_its_routing_entries_alive(setup, tiny):
    from jobs import keys
    from jobs.prefixes import ROUTE_TTL_S

    worker, client = setup(prefix_cache_bytes=BUDGET, max_batch_jobs=1)
    context = ids(100, 16)  # 3 whole blocks
    client.submit(tokens=context + [300], model=MODEL)
    worker.work(burst=True)
    entries = client.redis.keys(keys.PREFIX_ROUTE.format(key="*"))
    assert entries
    for entry in entries:
        client.redis.expire(entry, 5)  # as if written long ago
    worker.prefixes._routed.clear()
    client.submit(tokens=context + [301], model=MODEL)
    worker.work(burst=True)  # it reuses the 3 blocks: their entries are written again
    assert all(client.redis.ttl(e) > ROUTE_TTL_S - 60 for e in entries)
    for entry in entries:  # a second reuse soon after writes nothing
        client.redis.expire(entry, 5)
    client.submit(tokens=context + [302], model=MODEL)
    worker.work(burst=True)
    assert all(client.redis.ttl(e) <= 5 for e in entries)
