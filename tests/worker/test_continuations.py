"""`submit(continuations=...)` through a worker on the tiny Gemma 3 and a real redis-server
(and fakeredis): the prompt is prefilled once and each continuation scored from its end, with
the log-probabilities, greedy verdict and top K of a cold prefill of prompt + continuation;
text continuations split as lm-eval splits a (context, continuation) pair; bad input fails
the job (or the submit) with a typed error and the worker carries on."""

from __future__ import annotations

import numpy as np
import pytest

from jobs import InvalidRequest, JobFailed, JobState, PromptTooLong, TokenOutOfRange
from jobs.limits import Limits
from model.logprobs import top_k

from .helpers import MODEL, ids

# as tests/model/test_continuations.py: continuation against cold, max |logprob diff| over
# the largest |logprob| compared (measured up to 4.6e-7 across the models there)
BOUND = 5e-6


def _cold(tiny, context: list[int], continuation: list[int], k: int = 2):
    """Entries of the continuation's positions in a cold prefill's prompt logprobs, and
    its final logits."""
    prefill = tiny.start_prefill([*context, *continuation], prompt_logprobs=k)
    logits = prefill.run()
    lp, n = prefill.logprobs, len(context)
    rows = slice(n, n + len(continuation))
    return lp.token_logprob[rows], lp.top_ids[rows], lp.top_logprobs[rows], logits


def _assert_scored_as_cold(tiny, context, continuation, scored, k: int = 0) -> None:
    token, top_ids, top_lp, final = _cold(tiny, context, continuation, max(k, 1))
    scale = float(np.abs(token).max())
    assert scored.tokens == continuation
    assert float(np.abs(np.array(scored.token_logprobs) - token).max()) <= BOUND * scale
    assert scored.logprob == pytest.approx(float(token.sum(dtype=np.float64)),
                                           abs=BOUND * scale * len(token))
    assert scored.is_greedy == bool(np.array_equal(top_ids[:, 0], continuation))
    assert [[t["id"] for t in row] for row in scored.top] == top_ids[:, :k].tolist()
    for row, values in zip(scored.top, top_lp[:, :k], strict=True):
        assert np.allclose([t["logprob"] for t in row], values, atol=BOUND * scale)
    expected = top_k(final, len(scored.top_k))  # the job's top_k after the continuation
    assert [t.id for t in scored.top_k] == [t.id for t in expected]
    assert [t.piece for t in scored.top_k] == [tiny.tokenizer.piece(t.id) for t in expected]


def test_each_continuation_is_scored_from_the_end_of_the_prompt_beside_other_jobs(setup, tiny):
    worker, client = setup()
    context = ids(70, 1)  # past the tiny model's 16-token window, in chunks of 16
    continuations = [ids(4, 2)[1:], ids(30, 3)[1:], [300]]
    job = client.submit(tokens=context, continuations=continuations, model=MODEL, top_k=3)
    other = client.submit(tokens=ids(40, 4), model=MODEL, top_k=3)
    worker.work(burst=True)
    result = client.result(job, timeout=0)
    assert client.status(job).state == JobState.FINISHED
    assert client.status(other).state == JobState.FINISHED
    assert result.n_tokens == 70  # the prompt's; its top_k is the prompt's next token
    ref = tiny.start_prefill(context).run()
    assert [t.id for t in result.top_k] == [int(i) for i in np.argsort(-ref)[:3]]
    assert len(result.continuations) == 3
    assert all(len(c.top_k) == 3 for c in result.continuations)
    for continuation, scored in zip(continuations, result.continuations, strict=True):
        _assert_scored_as_cold(tiny, context, continuation, scored)
    assert client.result(other, timeout=0).continuations is None


def test_a_greedy_continuation_is_reported_greedy(setup, tiny):
    worker, client = setup()
    context = ids(20, 5)
    greedy = []
    for _ in range(3):
        greedy.append(int(np.argmax(tiny.start_prefill([*context, *greedy]).run())))
    changed = [greedy[0], (greedy[1] + 1) % tiny.vocab_size, greedy[2]]
    job = client.submit(tokens=context, continuations=[greedy, changed], model=MODEL)
    worker.work(burst=True)
    kept, other = client.result(job, timeout=0).continuations
    assert kept.is_greedy and not other.is_greedy
    assert kept.logprob > other.logprob


def test_prompt_logprobs_cover_the_prompt_and_give_continuations_their_top_k(setup, tiny):
    worker, client = setup()
    context = ids(33, 6)
    continuation = ids(9, 7)[1:]
    job = client.submit(tokens=context, continuations=[continuation], prompt_logprobs=2,
                        model=MODEL)
    worker.work(burst=True)
    result = client.result(job, timeout=0)
    assert len(result.prompt_logprobs) == len(context) + 1
    _assert_scored_as_cold(tiny, context, continuation, result.continuations[0], k=2)


def test_text_continuations_are_the_tokens_after_the_prompts_own(setup, tiny):
    worker, client = setup()
    prompt = "Question: what is red? Answer:"
    choices = [" apple", " the sky", " 42"]
    job = client.submit(prompt=prompt, continuations=choices, model=MODEL)
    worker.work(burst=True)
    result = client.result(job, timeout=0)
    context = tiny.tokenizer.encode(prompt)
    for choice, scored in zip(choices, result.continuations, strict=True):
        expected = tiny.tokenizer.encode(prompt + choice)[len(context):]
        assert scored.tokens == expected
        _assert_scored_as_cold(tiny, context, expected, scored)


def test_the_prefix_cache_serves_a_second_question_on_the_same_context(setup, tiny):
    worker, client = setup(prefix_cache_bytes=64 << 20, max_batch_jobs=1)
    context = ids(100, 8)
    first = client.submit(tokens=context, continuations=[[300, 301]], model=MODEL)
    worker.work(burst=True)
    second = client.submit(tokens=context, continuations=[[302, 303, 304]], model=MODEL)
    worker.work(burst=True)
    status = client.status(second)
    assert (status.state, status.reuse, status.cached_tokens) == (JobState.FINISHED, "prefix",
                                                                  96)
    for job, continuation in ((first, [300, 301]), (second, [302, 303, 304])):
        _assert_scored_as_cold(tiny, context, continuation,
                               client.result(job, timeout=0).continuations[0])


def test_bad_continuations_are_refused_at_submit(setup):
    _, client = setup()
    with pytest.raises(InvalidRequest, match="prompt or tokens"):
        client.submit(messages=[{"role": "user", "content": "hi"}], continuations=["a"],
                      model=MODEL)
    with pytest.raises(InvalidRequest, match="session"):
        client.submit(tokens=[2, 300], continuations=[[301]], session="s", model=MODEL)
    with pytest.raises(InvalidRequest, match=r"continuations\[1\]"):
        client.submit(tokens=[2, 300], continuations=[[301], "x"], model=MODEL)
    with pytest.raises(InvalidRequest, match=r"continuations\[0\] must be a non-empty string"):
        client.submit(prompt="hello", continuations=[[301]], model=MODEL)
    with pytest.raises(InvalidRequest, match="continuations must be a list of 1"):
        client.submit(tokens=[2, 300], continuations=[], model=MODEL)
    with pytest.raises(TokenOutOfRange, match=r"continuations\[0\]: token id 9999"):
        client.submit(tokens=[2, 300], continuations=[[9999]], model=MODEL)
    with pytest.raises(PromptTooLong, match="continuations have 9 tokens"):
        client.limits = Limits(max_continuation_tokens=8)
        client.submit(tokens=[2, 300], continuations=[[301] * 5, [302] * 4], model=MODEL)


def test_continuations_over_the_workers_limit_fail_their_job_only(setup):
    worker, client = setup(limits=Limits(max_continuation_tokens=4))
    long = client.submit(prompt="red", continuations=[" apple pie"], model=MODEL)
    fine = client.submit(prompt="red", continuations=[" pie"], model=MODEL)
    worker.work(burst=True)
    with pytest.raises(JobFailed) as failed:
        client.result(long, timeout=0)
    assert failed.value.error_type == "PromptTooLong"
    assert "continuations have" in failed.value.message
    assert len(client.result(fine, timeout=0).continuations) == 1
