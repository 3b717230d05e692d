"""Chunk planning for prefill: a plan is a pure function of (prompt length, chunk size,
window, cursor), so a job planned once can be continued at the same boundaries anywhere.

The window-aligned sizing rules (`matrix_prefill_chunk_len`,
`balance_fresh_three_chunk_prefill`) are ports of hf2q's functions of the same names. All
sizes are in tokens. The default chunk is window-aligned: ``DEFAULT_CHUNK_TOKENS`` is 16
DeepSeek-V4 windows of 128 and 4 Gemma 3 windows of 512.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

DEFAULT_CHUNK_TOKENS = 2048
# The last tokens of a prompt are the ones a chat template rewrites on the next turn; the
# cache is snapshotted just before them (the turn anchor).
RECOVERY_TAIL_TOKENS = 8
# hf2q's matrix kernel needs this many rows; shorter cached suffixes replay token by token.
MIN_MATRIX_APPEND_TOKENS = 33


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def matrix_prefill_chunk_len(
    cache_position: int, remaining: int, sliding_window: int, window_multiplier: int
) -> int:
    """Tokens in the next chunk: ``window * multiplier`` capped by what remains.

    Returns 0 when nothing should run as a matrix chunk: nothing remains, a zero window or
    multiplier, or a cached prefix followed by fewer than ``MIN_MATRIX_APPEND_TOKENS``
    (hf2q replays those one token at a time).
    """
    if remaining <= 0 or sliding_window <= 0 or window_multiplier <= 0:
        return 0
    if cache_position > 0 and remaining < MIN_MATRIX_APPEND_TOKENS:
        return 0
    return min(remaining, sliding_window * window_multiplier)


def balance_fresh_three_chunk_prefill(
    cache_position: int, token_count: int, sliding_window: int, default_windows: int
) -> int:
    """Windows per chunk, balancing a fresh prompt of two to three default chunks into three.

    A prompt just over two default chunks would otherwise end in a small third chunk; three
    equal window-aligned chunks cost the same passes with no ragged tail. Outside that band,
    or with a warm cache, the default is kept.
    """
    if cache_position != 0 or sliding_window <= 0 or default_windows <= 0:
        return default_windows
    default_chunk = sliding_window * default_windows
    if token_count <= 2 * default_chunk or token_count >= 3 * default_chunk:
        return default_windows
    windows = _ceil_div(_ceil_div(token_count, 3), sliding_window)
    return max(1, min(windows, default_windows))


def recovery_position(n_tokens: int) -> int:
    """Where the turn anchor is snapshotted: ``n_tokens - 8``, clamped at 0."""
    return max(0, n_tokens - RECOVERY_TAIL_TOKENS)


@dataclass(frozen=True)
class ChunkPlan:
    """The chunk sizes of one prefill from `start` to `n_tokens`.

    Attributes:
        n_tokens: prompt length in tokens.
        chunk_sizes: tokens per forward pass, in order; they sum to ``n_tokens - start``.
        recovery_position: ``n_tokens - 8`` clamped at 0 (a boundary only with ``anchor``).
        start: the cache position the plan starts from (0 for a cold prefill).
    """

    n_tokens: int
    chunk_sizes: tuple[int, ...]
    recovery_position: int
    start: int = 0

    @cached_property
    def boundaries(self) -> tuple[int, ...]:
        """Cache positions after each chunk; the last is ``n_tokens``. Computed once: a
        worker asks for the next chunk several times a step, and a long prompt in small
        chunks made that quadratic in its chunks."""
        return tuple(accumulate(self.chunk_sizes, initial=self.start))[1:]

    def next_chunk(self, cursor: int) -> tuple[int, int]:
        """``(start, end)`` of the chunk that begins at `cursor` (a binary search of the
        boundaries).

        Raises:
            ValueError: `cursor` is not a chunk boundary of this plan, or the prefill is done.
        """
        ends = self.boundaries
        if cursor == self.start and ends:
            return cursor, ends[0]
        i = bisect_left(ends, cursor)
        if i + 1 < len(ends) and ends[i] == cursor:
            return cursor, ends[i + 1]
        raise ValueError(f"cursor {cursor} is not a pending chunk boundary of {self}")

    @classmethod
    def from_boundaries(
        cls, n_tokens: int, boundaries: Sequence[int], *, start: int = 0
    ) -> ChunkPlan:
        """The plan whose chunks end at `boundaries` (as recorded from `boundaries`).

        Raises:
            ValueError: `boundaries` is empty, not strictly increasing from `start`, or does
                not end at `n_tokens`.
        """
        ends = [int(b) for b in boundaries]
        if not ends or ends[-1] != n_tokens:
            raise ValueError(f"chunk boundaries {ends} do not end at the prompt's {n_tokens} "
                             "tokens")
        sizes, previous = [], start
        for end in ends:
            if end <= previous:
                raise ValueError(f"chunk boundaries {ends} are not increasing from {start}")
            sizes.append(end - previous)
            previous = end
        return cls(n_tokens=n_tokens, chunk_sizes=tuple(sizes),
                   recovery_position=recovery_position(n_tokens), start=start)


def plan_chunks(
    n_tokens: int,
    sliding_window: int,
    *,
    chunk_tokens: int | None = None,
    default_chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    anchor: bool = False,
    cursor: int = 0,
) -> ChunkPlan:
    """Plan a prefill of `n_tokens` tokens from cache position `cursor`.

    Chunks of one size end at multiples of it counted from `cursor`; the last one is cut at
    `n_tokens`.

    Args:
        n_tokens: prompt length (>= 1).
        sliding_window: the model's native window in tokens (Gemma 3: 512; DeepSeek-V4: 128).
        chunk_tokens: an exact chunk size (any N >= 1, aligned or not); turns balancing off.
            N >= n_tokens - cursor means one forward pass.
        default_chunk_tokens: the window-aligned default used when `chunk_tokens` is None.
        anchor: also end a chunk at ``recovery_position`` (jobs that belong to a session),
            when it lies after `cursor`.
        cursor: tokens already in the cache (0 for a cold prefill); ``0 <= cursor < n_tokens``.

    Raises:
        ValueError: `n_tokens` < 1, `chunk_tokens` < 1, or `cursor` outside ``[0, n_tokens)``.
    """
    if n_tokens < 1:
        raise ValueError(f"cannot plan a prefill of {n_tokens} tokens")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if not 0 <= cursor < n_tokens:
        raise ValueError(f"cursor {cursor} is outside [0, {n_tokens})")
    anchor_at = recovery_position(n_tokens)
    if chunk_tokens is not None:
        size = chunk_tokens
    else:
        window = max(1, sliding_window)
        default_windows = max(1, default_chunk_tokens // window)
        windows = balance_fresh_three_chunk_prefill(cursor, n_tokens, window, default_windows)
        size = window * windows
    stops = {min(n_tokens, end) for end in range(cursor + size, n_tokens + size, size)}
    if anchor and cursor < anchor_at < n_tokens:
        stops.add(anchor_at)
    sizes, start = [], cursor
    for end in sorted(stops):
        sizes.append(end - start)
        start = end
    return ChunkPlan(n_tokens=n_tokens, chunk_sizes=tuple(sizes), recovery_position=anchor_at,
                     start=cursor)


def check_prompt(token_ids: Sequence[int], vocab_size: int, context_length: int) -> list[int]:
    """`token_ids` as a list of ints, checked against the vocabulary and the context.

    Raises:
        ValueError: no ids, more than `context_length` of them, or an id outside
            ``[0, vocab_size)``.
    """
    ids = [int(t) for t in token_ids]
    if not ids or len(ids) > context_length:
        raise ValueError(f"a prompt of {len(ids)} tokens does not fit a context of "
                         f"{context_length}")
    if not all(0 <= t < vocab_size for t in ids):
        raise ValueError(f"a token id is outside the vocabulary [0, {vocab_size})")
    return ids
