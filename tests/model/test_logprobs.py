"""Prompt log-probabilities (`model.logprobs`): chunked equals one pass (tests/exactness.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from model.logprobs import PromptLogprobs, chunk_head, top_k
from tests.exactness import EXACT_RTOL

IDS = [2, *range(260, 330)]  # 71 ids of the tiny Gemma 3's text tokens
K = 5


def one_pass(loaded, ids: list[int]) -> np.ndarray:
    """``(n, vocab)`` log-softmax of the head on every position of one forward, in float64
    (MLX's float32 logsumexp over Gemma 3's 262,144 logits is 2.9e-4 off: `model.logprobs`)."""
    model = loaded.model
    cache = model.make_cache(loaded.dtype, capacity=len(ids), context_length=len(ids))
    every = model(mx.array(ids, dtype=mx.int32)[None], cache, every_position=True)
    logits = np.array(model.logits(every[0]).astype(mx.float32)).astype(np.float64)
    peak = logits.max(axis=-1, keepdims=True)
    return logits - peak - np.log(np.exp(logits - peak).sum(axis=-1, keepdims=True))


def check(loaded, ids, chunk_tokens, bound) -> float:
    """Assert the contract on every position; returns max |diff| / max |logprob|."""
    ref = one_pass(loaded, ids)
    prefill = loaded.start_prefill(ids, chunk_tokens=chunk_tokens, prompt_logprobs=K)
    logits = prefill.run()
    lp = prefill.logprobs
    n = len(ids)
    assert np.isnan(lp.token_logprob[0]) and np.isnan(lp.token_logprob[n])
    expected = ref[np.arange(n - 1), ids[1:]]
    scale = float(np.abs(ref).max())
    diff = float(np.abs(lp.token_logprob[1:n] - expected).max())
    top_ref = np.take_along_axis(ref[: n - 1], lp.top_ids[1:n], axis=-1)
    diff = max(diff, float(np.abs(lp.top_logprobs[1:n] - top_ref).max()))
    print(f"measured {diff / scale:.3g}")
    assert diff <= EXACT_RTOL * scale and diff <= bound * scale, diff / scale
    # the argmax must match wherever top-1 and top-2 are further apart than the tolerance
    margin = np.diff(np.sort(ref[: n - 1], axis=-1)[:, -2:], axis=-1)[:, 0]
    clear = margin > 2 * EXACT_RTOL * scale
    assert clear.mean() >= 0.9, clear.mean()  # so the check covers most positions
    np.testing.assert_array_equal(lp.top_ids[1:n, 0][clear], ref[: n - 1].argmax(-1)[clear])
    assert (np.diff(lp.top_logprobs[1:], axis=-1) <= 0).all()  # highest first
    final = top_k(logits, K)  # the job's top_k result
    assert lp.top_ids[n].tolist() == [t.id for t in final]
    # the same values, stored as float32
    np.testing.assert_array_equal(lp.top_logprobs[n], np.float32([t.logprob for t in final]))
    np.testing.assert_array_equal(lp.top_ids[n, 0], ref[n - 1].argmax())
    return diff / scale


@pytest.mark.parametrize("chunk_tokens", [1, 7, None])
def test_tiny_gemma3_chunked_logprobs_equal_one_pass(tiny, chunk_tokens):
    check(tiny, IDS, chunk_tokens, 1e-6)  # measured <= 2.4e-7 (float32 on CPU)


@pytest.mark.parametrize("chunk_tokens", [1, 7, None])
def test_gemma3_270m_chunked_logprobs_equal_one_pass(gemma, chunk_tokens):
    ids = gemma.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    check(gemma, ids, chunk_tokens, 2e-6)  # measured <= 3.3e-7 (float32 on CPU)


def test_one_token_prompt_has_only_the_final_position(tiny):
    prefill = tiny.start_prefill([2], prompt_logprobs=3)
    logits = prefill.run()
    assert prefill.logprobs.filled == 1 and np.isnan(prefill.logprobs.token_logprob).all()
    assert prefill.logprobs.top_ids[1].tolist() == [t.id for t in top_k(logits, 3)]


def test_normal_jobs_keep_no_logprobs(tiny):
    prefill = tiny.start_prefill(IDS, chunk_tokens=7)
    np.testing.assert_array_equal(prefill.run(),
                                  tiny.start_prefill(IDS, chunk_tokens=7,
                                                     prompt_logprobs=K).run())
    assert prefill.logprobs is None


@pytest.mark.parametrize("chunk_tokens", [7, 64, None])
def test_deepseek4_tiny_chunked_logprobs_equal_one_pass(chunk_tokens):
    from model.registry import load_model

    loaded = load_model("deepseek4-tiny", dtype=mx.float32)
    # the session tests' seed: its indexer and MoE choices have no near-tie (test_session.py)
    rng = np.random.default_rng(39)
    ids = list(map(int, rng.integers(0, loaded.vocab_size, 1000)))[:150]
    check(loaded, ids, chunk_tokens, 1e-6)  # measured <= 2.3e-7 (float32 on CPU)


class _Identity:
    """A stand-in output head: the hidden states are the logits."""

    @staticmethod
    def logits(hidden: mx.array) -> mx.array:
        return hidden


def test_top_1_per_position_is_the_first_maximum_as_top_k_orders_it():
    # k = 1 takes an argmax (argpartition sorts each row on a GPU: 10.8 ms against 0.2 for
    # 500 x 262,144 logits on the H200); it must agree with the k > 1 path's first column
    # after `_store`'s (logprob descending, then id) order, ties included
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 1000)).astype(np.float32)
    logits[1, [17, 400, 999]] = logits[1].max() + 1  # a three-way tie at the top
    logits[4, [3, 2]] = logits[4].max() + 1
    targets = [5, 17, 0, 999, 2, 7]
    every = mx.array(logits)[None]
    results = {}
    for k in (1, 5):
        lp = PromptLogprobs([0, *targets], k, vocab_size=1000)
        lp.record(0, tuple(mx.eval(x) or x for x in chunk_head(_Identity, every, targets, k)))
        results[k] = lp
    np.testing.assert_array_equal(results[1].top_ids[1:7, 0], results[5].top_ids[1:7, 0])
    np.testing.assert_array_equal(results[1].top_ids[1:7, 0], logits.argmax(-1))
    assert results[1].top_ids[2, 0] == 17 and results[1].top_ids[5, 0] == 2
    np.testing.assert_array_equal(results[1].top_logprobs[1:7, 0],
                                  results[5].top_logprobs[1:7, 0])
    np.testing.assert_array_equal(results[1].token_logprob, results[5].token_logprob)
