"""Chunk planning for cold prefill, ported from hf2q (seeds 000 and 002).

All sizes are in tokens. The default chunk is window-aligned: ``DEFAULT_CHUNK_TOKENS`` is 16
DeepSeek-V4 windows of 128 and 4 Gemma 3 windows of 512.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    (hf2q replays those one token at a time; seeds 002 ``matrix_prefill_chunk_len``).
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
    equal window-aligned chunks cost the same passes with no ragged tail (seeds 000
    ``balance_fresh_three_chunk_prefill``). Outside that band, or with a warm cache, the
    default is kept.
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
    """The chunk sizes of one cold prefill.

    Attributes:
        n_tokens: prompt length in tokens.
        chunk_sizes: tokens per forward pass, in order; they sum to ``n_tokens``.
        recovery_position: ``n_tokens - 8`` clamped at 0 (a boundary only with ``anchor``).
    """

    n_tokens: int
    chunk_sizes: tuple[int, ...]
    recovery_position: int

    @property
    def boundaries(self) -> tuple[int, ...]:
        """Cache positions after each chunk; the last is ``n_tokens``."""
        out, total = [], 0
        for size in self.chunk_sizes:
            total += size
            out.append(total)
        return tuple(out)

    def next_chunk(self, cursor: int) -> tuple[int, int]:
        """``(start, end)`` of the chunk that begins at `cursor`.

        Raises:
            ValueError: `cursor` is not a chunk boundary of this plan, or the prefill is done.
        """
        start = 0
        for end in self.boundaries:
            if start == cursor:
                return start, end
            start = end
        raise ValueError(f"cursor {cursor} is not a pending chunk boundary of {self}")


def plan_chunks(
    n_tokens: int,
    sliding_window: int,
    *,
    chunk_tokens: int | None = None,
    default_chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    anchor: bool = False,
) -> ChunkPlan:
    """Plan a cold prefill of `n_tokens` tokens.

    Args:
        n_tokens: prompt length (>= 1).
        sliding_window: the model's native window in tokens (Gemma 3: 512; DeepSeek-V4: 128).
        chunk_tokens: an exact chunk size (any N >= 1, aligned or not); turns balancing off.
            N >= n_tokens means one forward pass.
        default_chunk_tokens: the window-aligned default used when `chunk_tokens` is None.
        anchor: also end a chunk at ``recovery_position`` (jobs that belong to a session).

    Raises:
        ValueError: `n_tokens` < 1 or `chunk_tokens` < 1.
    """
    if n_tokens < 1:
        raise ValueError(f"cannot plan a prefill of {n_tokens} tokens")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    anchor_at = recovery_position(n_tokens)
    if chunk_tokens is not None:
        size = chunk_tokens
    else:
        window = max(1, sliding_window)
        default_windows = max(1, default_chunk_tokens // window)
        windows = balance_fresh_three_chunk_prefill(0, n_tokens, window, default_windows)
        size = window * windows
    stops = {min(n_tokens, end) for end in range(size, n_tokens + size, size)}
    if anchor and 0 < anchor_at < n_tokens:
        stops.add(anchor_at)
    sizes, start = [], 0
    for end in sorted(stops):
        sizes.append(end - start)
        start = end
    return ChunkPlan(n_tokens=n_tokens, chunk_sizes=tuple(sizes), recovery_position=anchor_at)
