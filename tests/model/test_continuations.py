"""`model.continuations`: each continuation scored from a fork of the context's cache gets the
log-probabilities a cold prefill of context + continuation gives its positions, with the same
top ids and greedy verdict, on every architecture: the tiny Gemma 3 (16-token window, so
continuations cross windows), a tiny Llama-family model, DeepSeek-V4's compressed cache
(forked through its state), Gemma 3 270M and SmolLM2-135M."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from model.continuations import score_continuations
from model.logprobs import logprobs_of, top_k
from model.prefill import Prefill
from model.registry import load_model

# max |logprob diff| over the largest |logprob| compared, continuation against cold: the
# forked rows are the context's own numbers, the continuation's chunk cuts the matmuls
# elsewhere (the chunked-vs-one-pass bound of tests/model/test_prefix_cache.py)
BOUND = 5e-6
K = 3
LABELS = (5, 7, 200)  # generative scoring's label tokens (every tiny vocabulary has them)


@pytest.fixture(scope="module", params=["gemma3-tiny", "qwen3-tiny", "deepseek4-tiny"])
def tiny_model(request):
    return load_model(request.param, dtype=mx.float32)


def _ids(rng, n: int, vocab: int, bos: bool = True) -> list[int]:
    body = [int(t) for t in rng.integers(3, vocab, n - bos)]
    return [2, *body] if bos else body


def _context(loaded, ids: list[int], chunk: int | None = None):
    prefill = loaded.start_prefill(ids, chunk_tokens=chunk)
    return prefill, prefill.run()


def _cold(loaded, ids: list[int], n: int, k: int = K):
    """Entries n.. of a cold prefill's prompt logprobs (token logprobs, top ids, top
    logprobs), and its final logits."""
    prefill = loaded.start_prefill(ids, prompt_logprobs=k)
    logits = prefill.run()
    lp = prefill.logprobs
    rows = slice(n, len(ids))
    return lp.token_logprob[rows], lp.top_ids[rows], lp.top_logprobs[rows], logits


def _check(loaded, context_ids, continuations, scores, k: int = K, n_top: int = K,
           labels: tuple[int, ...] = ()) -> float:
    """Each score against the cold prefill of its whole prompt; the worst relative diff."""
    worst = 0.0
    n = len(context_ids)
    for continuation, score in zip(continuations, scores, strict=True):
        token, top_ids, top_lp, final = _cold(loaded, [*context_ids, *continuation], n,
                                              max(k, 1))
        assert score.token_ids == continuation
        scale = float(np.abs(token).max())
        diff = float(np.abs(np.array(score.token_logprobs) - token).max())
        assert diff <= BOUND * scale, (diff, scale)
        assert score.logprob == pytest.approx(float(token.astype(np.float64).sum()),
                                              abs=BOUND * scale * len(token))
        assert score.is_greedy == bool(np.array_equal(top_ids[:, 0], continuation))
        assert np.array(score.top_ids).tolist() == top_ids[:, :k].tolist()
        assert np.allclose(score.top_logprobs, top_lp[:, :k], atol=BOUND * scale)
        expected = top_k(final, n_top)  # what a generation would add after it
        assert [t.id for t in score.top_k] == [t.id for t in expected]
        assert np.allclose([t.logprob for t in score.top_k], [t.logprob for t in expected],
                           atol=BOUND * scale)
        assert np.allclose(score.label_logprobs, logprobs_of(final, labels), rtol=0,
                           atol=BOUND * scale)
        worst = max(worst, diff / scale)
    return worst


@pytest.mark.parametrize("n, lengths, chunk", [
    (9, [1, 3, 7], None),        # the context inside the first 16-token window
    (40, [2, 20, 33], 7),        # continuations of several chunks, crossing windows
    (64, [5, 1, 16, 17], 16),    # a context on a window edge
])
def test_each_continuation_scores_as_a_cold_prefill_of_its_whole_prompt(tiny_model, n,
                                                                        lengths, chunk):
    rng = np.random.default_rng(n)
    context_ids = _ids(rng, n, tiny_model.vocab_size)
    continuations = [_ids(rng, m, tiny_model.vocab_size, bos=False) for m in lengths]
    context, logits = _context(tiny_model, context_ids)
    scores = score_continuations(context, logits, continuations, k=K, top_k=K,
                                 label_ids=LABELS, vocab_size=tiny_model.vocab_size,
                                 chunk_tokens=chunk)
    assert all(len(s.label_logprobs) == len(LABELS) for s in scores)
    _check(tiny_model, context_ids, continuations, scores, labels=LABELS)


def test_a_greedy_continuation_is_recognized_and_a_changed_one_is_not(tiny):
    rng = np.random.default_rng(7)
    context_ids = _ids(rng, 30, tiny.vocab_size)
    greedy = []  # the argmax continuation, token by token
    for _ in range(4):
        logits = tiny.start_prefill([*context_ids, *greedy]).run()
        greedy.append(int(np.argmax(logits)))
    other = [*greedy[:2], (greedy[2] + 1) % tiny.vocab_size, greedy[3]]
    context, logits = _context(tiny, context_ids)
    kept, changed = score_continuations(context, logits, [greedy, other],
                                        vocab_size=tiny.vocab_size)
    assert kept.is_greedy and not changed.is_greedy
    assert kept.top_ids == [[], [], [], []] and kept.top_k == []  # k = top_k = 0: none
    assert kept.logprob > changed.logprob


def test_the_context_cache_is_left_as_it_was(tiny):
    rng = np.random.default_rng(3)
    context_ids = _ids(rng, 50, tiny.vocab_size)
    continuations = [_ids(rng, m, tiny.vocab_size, bos=False) for m in (12, 30)]
    context, logits = _context(tiny, context_ids, chunk=16)
    before = [np.array(a) for a in context.cache.arrays()]
    first = score_continuations(context, logits, continuations, vocab_size=tiny.vocab_size)
    assert context.cursor == 50
    for a, b in zip(before, context.cache.arrays(), strict=True):
        assert np.array_equal(a, np.array(b))
    # scored again from the same context: the same numbers, bit for bit
    again = score_continuations(context, logits, continuations, vocab_size=tiny.vocab_size)
    assert [s.token_logprobs for s in again] == [s.token_logprobs for s in first]
    # in the other order, the packed pass holds each continuation's rows elsewhere, and a
    # CPU BLAS rounds a row by where it sits (OpenBLAS's AVX2 "Haswell" sgemm changed 24 of
    # 42 rows of a (42, 64) @ (64, 365) product when the rows were permuted; on AVX-512
    # kernels this case happened to match): within the continuation-vs-cold BOUND
    reordered = score_continuations(context, logits, continuations[::-1],
                                    vocab_size=tiny.vocab_size)
    for a, b in zip(reordered[::-1], first, strict=True):
        scale = float(np.abs(b.token_logprobs).max())
        assert float(np.abs(np.subtract(a.token_logprobs, b.token_logprobs)).max()) \
            <= BOUND * scale


def test_continuations_need_a_done_context_that_kept_its_cache(tiny):
    ids = _ids(np.random.default_rng(1), 20, tiny.vocab_size)
    unkept = tiny.start_prefill(ids, keep_cache=False)
    logits = unkept.run()
    with pytest.raises(ValueError, match="kept its cache"):
        score_continuations(unkept, logits, [[5, 6]], vocab_size=tiny.vocab_size)
    context, logits = _context(tiny, ids)
    with pytest.raises(ValueError, match=r"continuations\[1\] is empty"):
        score_continuations(context, logits, [[5], []], vocab_size=tiny.vocab_size)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3-270m", "smollm2-135m"])
def test_real_models_score_continuations_as_cold_prefills(name):
    loaded = load_model(name)
    rng = np.random.default_rng(11)
    # 600 tokens: past Gemma 3's 512-token window
    context_ids = _ids(rng, 600, min(loaded.vocab_size, 30_000))
    continuations = [_ids(rng, m, min(loaded.vocab_size, 30_000), bos=False)
                     for m in (3, 12, 20, 1)]
    context, logits = _context(loaded, context_ids, chunk=256)
    scores = score_continuations(context, logits, continuations, k=K, top_k=K,
                                 vocab_size=loaded.vocab_size)
    _check(loaded, context_ids, continuations, scores)


def test_a_forward_pass_carries_at_most_a_chunk_of_continuation_tokens(tiny, monkeypatch):
    rng = np.random.default_rng(5)
    context_ids = _ids(rng, 30, tiny.vocab_size)
    continuations = [_ids(rng, m, tiny.vocab_size, bos=False) for m in (5, 5, 5, 12)]
    context, logits = _context(tiny, context_ids)
    passes = []
    launch_all = Prefill.launch_all

    def counted(prefills, ahead=False):  # the real launch, its tokens counted
        passes.append(sum(p.next_chunk_tokens for p in prefills))
        launch_all(prefills, ahead)

    monkeypatch.setattr(Prefill, "launch_all", staticmethod(counted))
    scores = score_continuations(context, logits, continuations, vocab_size=tiny.vocab_size,
                                 chunk_tokens=10)
    # round 1: 5 + 5, then 5 (the 12-token one's first chunk of 10 does not fit beside it),
    # then 10; round 2: its last 2
    assert passes == [10, 5, 10, 2]
    _check(tiny, context_ids, continuations, scores, k=0, n_top=0)

