"""Prompt log-probabilities through Redis and a worker: stored, decoded, exact
(tests/exactness.py)."""

from __future__ import annotations

import numpy as np

from jobs import keys
from tests.exactness import EXACT_RTOL
from tests.model.test_logprobs import one_pass

from .helpers import MODEL, ids

K = 4


def test_a_jobs_prompt_logprobs_equal_one_pass_and_its_top_k(setup, tiny, redis_conn):
    worker, client = setup(logits_ttl_s=123)
    token_ids = ids(50, 7)
    job = client.submit(tokens=token_ids, model=MODEL, top_k=K, prompt_logprobs=K)
    plain = client.submit(tokens=token_ids, model=MODEL, top_k=K)
    worker.work(burst=True)
    result = client.result(job, timeout=0)
    assert client.result(plain, timeout=0).prompt_logprobs is None
    assert redis_conn().ttl(keys.prompt_logprobs(plain)) == -2  # no key for a plain job
    assert 0 < redis_conn().ttl(keys.prompt_logprobs(job)) <= 123  # the logits' TTL
    assert result.chunks_done == 4  # 16-token chunks: computed chunk by chunk
    entries, n = result.prompt_logprobs, len(token_ids)
    assert len(entries) == n + 1
    assert entries[0] == {"token": token_ids[0], "logprob": None, "top": []}
    assert [e["token"] for e in entries] == [*token_ids, None]
    assert entries[n]["logprob"] is None
    ref = one_pass(tiny, token_ids)
    scale = float(np.abs(ref).max())
    got = np.array([e["logprob"] for e in entries[1:n]])
    diff = float(np.abs(got - ref[np.arange(n - 1), token_ids[1:]]).max())
    assert diff <= EXACT_RTOL * scale and diff <= 1e-6 * scale  # measured ~2e-7
    for i in range(1, n):
        top = entries[i]["top"]
        assert len(top) == K
        np.testing.assert_allclose([t["logprob"] for t in top],
                                   ref[i - 1][[t["id"] for t in top]], atol=1e-6 * scale)
    final = [(t["id"], t["logprob"]) for t in entries[n]["top"]]
    assert final == [(t.id, float(np.float32(t.logprob))) for t in result.top_k]


def test_a_prompt_logprobs_job_is_not_checkpointed(setup, tmp_path, on_chunk):
    worker, client = setup(checkpoint_store=f"file://{tmp_path}/ckpt", checkpoint_every="1")
    seen = {}
    on_chunk(lambda job, _: seen.setdefault(job, worker.stepper.active[job].checkpoints))
    job = client.submit(tokens=ids(50, 8), model=MODEL, prompt_logprobs=2)
    plain = client.submit(tokens=ids(50, 8), model=MODEL)  # the control: it is checkpointed
    worker.work(burst=True)
    assert len(client.result(job, timeout=0).prompt_logprobs) == 51
    assert seen[job] is None and seen[plain] is not None  # a restart recomputes from 0


def test_cli_submit_prompt_logprobs_and_result_json(redis_server, tiny, tmp_path):
    import json

    import redis

    from tests.jobs.test_cli import light_prefillq
    from worker.worker import PrefillWorker

    redis.Redis.from_url(redis_server).flushall()
    worker = PrefillWorker({MODEL: tiny}, redis.Redis.from_url(redis_server), name="w1")
    worker.register_models()
    token_ids = ids(20, 9)
    (tmp_path / "ids.json").write_text(json.dumps(token_ids))
    submit = light_prefillq("submit", "--redis", redis_server, "--model", MODEL,
                            "--tokens-file", str(tmp_path / "ids.json"), "--prompt-logprobs", "2")
    assert submit.returncode == 0, submit.stderr
    worker.work(burst=True)
    result = light_prefillq("result", "--redis", redis_server, submit.stdout.split()[-1],
                            "--json")
    assert result.returncode == 0, result.stderr
    entries = json.loads(result.stdout)["prompt_logprobs"]
    assert [e["token"] for e in entries] == [*token_ids, None]
    assert entries[0]["logprob"] is None and all(len(e["top"]) == 2 for e in entries[1:])
