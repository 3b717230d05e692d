"""Log-probabilities: the top k of a job's final logits, and prompt log-probabilities (the
output head on every position of each chunk).

Only what a job returns (each next token's logprob and the top K) leaves the device, never
the ``(L, vocab)`` logits (docs/benchmarks.md, "Figures behind the code's choices", has the cost).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .chunk import PrefillModel


@dataclass
class TopToken:
    id: int
    logit: float
    logprob: float


def top_k(logits: np.ndarray, k: int) -> list[TopToken]:
    """The `k` highest of `logits` (float32 ``(vocab,)``), highest first (equal logits by
    id), with log-softmax over the whole vocabulary.

    ``log Z = max + log sum exp(logits - max)``, the exponentials in float32 and their sum
    in float64: over Gemma 3's 262,144 logits this and the selection (an argmax for k = 1,
    the common scoring case) take ~0.7 ms on a 2-core x86-64 VM where the float64
    exponentials and a partition for every k took 9.2 ms a job.
    """
    k = max(0, min(k, logits.shape[0]))
    if k == 0:
        return []
    if k == 1:
        ids = np.array([np.argmax(logits)])  # the first of equal maxima
    else:
        ids = np.argpartition(logits, -k)[-k:]
        ids = ids[np.lexsort((ids, -logits[ids]))]
    z = log_z(logits, float(logits[ids[0]]))
    return [TopToken(int(i), float(logits[i]), float(logits[i]) - z) for i in ids]


def logprobs_of(logits: np.ndarray, ids: Sequence[int]) -> list[float]:
    """The log-softmax of float32 ``(vocab,)`` `logits` at each of `ids` (`log_z`'s
    normalizer), in order."""
    if not len(ids):
        return []
    z = log_z(logits)
    return [float(logits[i]) - z for i in ids]


def log_z(logits: np.ndarray, peak: float | None = None) -> float:
    """``log sum exp(logits)`` of float32 ``(vocab,)`` logits, as ``peak + log sum exp(logits
    - peak)`` with the exponentials in float32 and their sum in float64 (`peak`: their
    maximum, computed when not given)."""
    peak = float(logits.max()) if peak is None else peak
    return peak + float(np.log(np.exp(logits - peak).sum(dtype=np.float64)))


# MLX's float32 logsumexp over a whole row sums it in one sequence on the CPU: over Gemma 3
# 270M's 262,144 logits it was 2.9e-4 off log Z (against a float64 sum; `log_z` is 2e-8 off).
# Summed in blocks of this many first, 6e-7 off, at the same speed (64 rows: 198 ms both).
LOGSUMEXP_BLOCK = 512


def logsumexp(logits: mx.array) -> mx.array:
    """``log sum exp`` of float32 ``(T, vocab)`` logits over the vocabulary, ``(T, 1)``: of
    each block of ``LOGSUMEXP_BLOCK`` first, then of those (the row padded with -inf)."""
    T, V = logits.shape
    pad = -V % LOGSUMEXP_BLOCK
    if pad:
        logits = mx.concatenate([logits, mx.full((T, pad), -mx.inf, logits.dtype)], axis=-1)
    blocks = mx.logsumexp(logits.reshape(T, -1, LOGSUMEXP_BLOCK), axis=-1)
    return mx.logsumexp(blocks, axis=-1, keepdims=True)


def chunk_head(model: PrefillModel, every: mx.array, targets: Sequence[int], k: int):
    """The lazy per-position results of one chunk's hidden states.

    Args:
        every: float ``(1, L, hidden)``: the chunk's final-normed hidden states.
        targets: the next prompt token after each position, ``len(targets)`` in ``{L - 1, L}``
            (a prompt's last position has none; its results come from the final logits).
        k: top alternatives per position, ``0 <= k <= vocab``.
    Returns:
        ``(token_logprob, top_ids, top_logprobs)``: float32 ``(T,)``, int32 ``(T, k)`` and
        float32 ``(T, k)`` for the first ``T = len(targets)`` positions (not evaluated).
    """
    n = len(targets)
    if n == 0:  # a one-token prompt's only position: the final logits give it
        return mx.zeros((0,), mx.float32), mx.zeros((0, k), mx.int32), mx.zeros((0, k))
    logits = model.logits(every[0, :n]).astype(mx.float32)  # (T, vocab)
    logprobs = logits - logsumexp(logits)
    target = mx.array(list(targets), dtype=mx.int32)[:, None]
    token = mx.take_along_axis(logprobs, target, axis=-1)[:, 0]
    if k == 0:
        return token, mx.zeros((n, 0), mx.int32), mx.zeros((n, 0), mx.float32)
    if k == 1:  # a reduction, where argpartition sorts each row on a GPU (see below)
        ids = mx.argmax(logprobs, axis=-1, keepdims=True).astype(mx.int32)
    else:
        ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k].astype(mx.int32)
    return token, ids, mx.take_along_axis(logprobs, ids, axis=-1)


class PromptLogprobs:
    """The per-position results of one prefill, filled chunk by chunk.

    Positions follow OpenAI's ``echo`` convention: entry i (0 <= i < n) is prompt token i
    with the logprob of ``ids[i]`` given ``ids[:i]`` (None at i = 0) and the top K given
    ``ids[:i]`` (empty at i = 0); entry n is the position after the prompt: no token, and
    the top K of the final logits, the same values as the job's ``top_k`` result.

    Args:
        token_ids: the prompt (n ids).
        k: top alternatives per position, clamped to ``[0, vocab_size]``.

    Attributes:
        token_logprob: float32 ``(n + 1,)``, NaN where there is none (entries 0 and n).
        top_ids, top_logprobs: int32 and float32 ``(n + 1, k)``, highest logprob first.
        block_tokens: when set, the final-normed hidden state of every position p with
            ``(p + 1) % block_tokens == 0`` is kept too (`block_hidden`, by block index), so a
            prefix cache can keep a block's entries and compute the one after its last
            position for any next token (`model.prefix_cache`).
    """

    def __init__(self, token_ids: Sequence[int], k: int, vocab_size: int):
        self.token_ids = [int(t) for t in token_ids]
        self.k = max(0, min(int(k), vocab_size))
        n = len(self.token_ids)
        self.token_logprob = np.full(n + 1, np.nan, np.float32)
        self.top_ids = np.zeros((n + 1, self.k), np.int32)
        self.top_logprobs = np.zeros((n + 1, self.k), np.float32)
        self.filled = 0  # entries 1..filled hold results
        self.block_tokens: int | None = None
        self.block_hidden: dict[int, mx.array] = {}  # block -> float (1, hidden)

    def launch(self, model: PrefillModel, every: mx.array, start: int) -> tuple:
        """The lazy head of the chunk at `start` (`chunk_head`), and with `block_tokens` the
        hidden states of the block ends in it, for `record`."""
        end = start + every.shape[1]
        head = chunk_head(model, every, self.token_ids[start + 1 : end + 1], self.k)
        if self.block_tokens is None:
            return head
        B = self.block_tokens
        ends = list(range(-(-(start + 1) // B) * B - 1, end, B))  # positions p, (p+1) % B == 0
        if not ends:
            return head
        return (*head, every[0, mx.array([p - start for p in ends], dtype=mx.int32)])

    def record(self, start: int, outputs: tuple) -> None:
        """Store the evaluated `launch` outputs of the chunk at `start`."""
        token, ids, values = (np.array(a) for a in outputs[:3])
        assert start == self.filled, f"chunk at {start} after results up to {self.filled}"
        rows = slice(start + 1, start + 1 + token.shape[0])
        self._store(rows, token, ids, values)
        self.filled = rows.stop - 1
        if len(outputs) > 3:
            first = -(-(start + 1) // self.block_tokens) - 1  # the first block ending here
            for i in range(outputs[3].shape[0]):
                self.block_hidden[first + i] = outputs[3][i : i + 1]

    def fill_prefix(self, model: PrefillModel, entries: Sequence[tuple], hidden: mx.array,
                    block_tokens: int) -> None:
        """Fill entries ``1..m * block_tokens`` of a prefill restored from m blocks of a
        prefix cache: `entries` gives each block's entries after its first position
        (``token_logprob (B - 1,)``, ``top_ids`` and ``top_logprobs`` ``(B - 1, K >= k)``,
        highest first), and the entry after each block's last position is computed from
        that position's hidden state, `hidden` float ``(m, hidden)`` (`chunk_head` on those
        rows, the next prompt token as target). Only an empty `PromptLogprobs` is filled.

        Raises:
            ValueError: results were recorded already, or a block kept fewer than k.
        """
        B, m = block_tokens, len(entries)
        if self.filled or any(e[1].shape[1] < self.k for e in entries):
            raise ValueError(f"fill_prefix needs empty results and blocks of K >= {self.k}")
        for b, (token, ids, values) in enumerate(entries):
            rows = slice(b * B + 1, (b + 1) * B)
            self.token_logprob[rows] = token
            self.top_ids[rows], self.top_logprobs[rows] = ids[:, : self.k], values[:, : self.k]
        targets = [self.token_ids[(b + 1) * B] for b in range(m)]
        head = chunk_head(model, hidden[None], targets, self.k)
        self._store([(b + 1) * B for b in range(m)], *(np.array(a) for a in head))
        self.filled = m * B

    def _store(self, rows, token: np.ndarray, ids: np.ndarray, values: np.ndarray) -> None:
        """Write evaluated `chunk_head` outputs at entries `rows` (a slice or indices), each
        entry's top K ordered by logprob descending, then id."""
        order = np.lexsort((ids, -values), axis=-1)
        self.token_logprob[rows] = token
        self.top_ids[rows] = np.take_along_axis(ids, order, axis=-1)
        self.top_logprobs[rows] = np.take_along_axis(values, order, axis=-1)

    def finish(self, logits: np.ndarray) -> None:
        """Fill entry n from the final logits, float32 ``(vocab,)`` (`top_k`'s values)."""
        n = len(self.token_ids)
        assert self.filled == n - 1, f"results up to {self.filled} of {n - 1}"
        top = top_k(logits, self.k)
        self.top_ids[n] = [t.id for t in top]
        self.top_logprobs[n] = [t.logprob for t in top]
        self.filled = n

    def start_at(self, position: int, logits: np.ndarray) -> None:
        """Fill entry `position` from `logits`, float32 ``(vocab,)``, the logits after
        ``ids[:position]`` (the last context position's, when a continuation starts there:
        `model.continuations`), leaving the entries before it empty; the chunks after it
        record from `position` on.

        Raises:
            ValueError: results were recorded already, or `position` is not in ``[1, n)``.
        """
        if self.filled or not 1 <= position < len(self.token_ids):
            raise ValueError(f"start_at({position}) needs empty results of a prompt longer "
                             f"than {position} tokens")
        top = top_k(logits, self.k)
        target = self.token_ids[position]
        self.token_logprob[position] = float(logits[target]) - log_z(logits)
        self.top_ids[position] = [t.id for t in top]
        self.top_logprobs[position] = [t.logprob for t in top]
        self.filled = position

    def reset(self) -> None:
        """Forget every result (the prefill restarts at 0)."""
        self.token_logprob[1:] = np.nan
        self.filled = 0
