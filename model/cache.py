"""The KV cache contract every architecture's cache follows (`CommittedCache`), its ring and mask.

The caches: `model.kv_cache.ModelCache` (global and sliding-window layers, Gemma 3) and
`model.archs.deepseek4.cache.Deepseek4Cache`. The commit-after-success contract follows
hf2q's ``Deepseek4Cache`` (github.com/robertelee78/hf2q, ``src/inference/models/deepseek4``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx

from .cache_state import (
    DTYPES,
    STATE_VERSION,
    BufferView,
    CacheState,
    load_buffers,
    save_buffers,
)


class CacheError(RuntimeError):
    """Base class of cache errors."""


class CachePoisoned(CacheError):
    """A chunk failed part-way; the cache must be ``reset()`` before further use."""


class ChunkInFlight(CacheError):
    """A launched chunk is neither committed nor abandoned: the buffers hold its writes."""


class ContextExhausted(CacheError):
    """A chunk would write past the cache's context length."""


class CacheStateError(CacheError, ValueError):
    """A saved state does not fit this cache: the message names the field or blob."""


def window_mask(q_start: int, n_q: int, k_start: int, n_k: int, window: int | None) -> mx.array:
    """Bool ``(n_q, n_k)``, True where query ``q_start + i`` may see key ``k_start + j``.

    Causal, and with a window a query at ``p`` sees keys in ``(p - window, p]``: HF Gemma 3's
    ``q_idx - kv_idx < sliding_window`` and the DeepSeek-V4 reference's window.
    """
    q = mx.arange(q_start, q_start + n_q)[:, None]
    k = mx.arange(k_start, k_start + n_k)[None, :]
    mask = k <= q
    return mask if window is None else mask & (q - k < window)


class RingBuffer:
    """The newest ``size`` rows of a sequence along ``axis``, row of position p at slot
    ``p % size`` (``size = data.shape[axis]``)."""

    def __init__(self, data: mx.array, axis: int = 0):
        self.data, self.axis = data, axis

    @property
    def size(self) -> int:
        return self.data.shape[self.axis]

    def _at(self, a: int, b: int) -> tuple[slice, ...]:
        return (slice(None),) * self.axis + (slice(a, b),)

    def read(self, start: int, stop: int) -> mx.array:
        """Rows of positions ``[start, stop)`` (at most ``size``), oldest first."""
        n = self.size
        assert 0 <= stop - start <= n, f"{stop - start} rows from a ring of {n}"
        a, b = start % n, stop % n
        if stop == start:
            return self.data[self._at(0, 0)]
        if a < b:
            return self.data[self._at(a, b)]
        return mx.concatenate([self.data[self._at(a, n)], self.data[self._at(0, b)]], self.axis)

    def write(self, rows: mx.array, start: int) -> None:
        """Keep the newest ``size`` of `rows` (positions ``[start, start + len)``)."""
        n, L = self.size, rows.shape[self.axis]
        keep = min(L, n)
        rows = rows[self._at(L - keep, L)].astype(self.data.dtype)
        a = (start + L - keep) % n
        first = min(keep, n - a)
        self.data[self._at(a, a + first)] = rows[self._at(0, first)]
        if first < keep:
            self.data[self._at(0, keep - first)] = rows[self._at(first, keep)]


class RowLog:
    """Every row written to a sequence, by position: pieces of arrays along ``axis`` (each
    the arrays a write gave, kept by reference), disjoint and in order. A write at position
    p supersedes the rows logged at or past p (a chunk run again after an abandon)."""

    def __init__(self, axis: int = 0):
        self.axis = axis
        self.pieces: list[tuple[int, tuple[mx.array, ...]]] = []

    def _length(self, arrays: tuple[mx.array, ...]) -> int:
        return arrays[0].shape[self.axis]

    def _cut(self, arrays: tuple[mx.array, ...], a: int, b: int) -> tuple[mx.array, ...]:
        at = (slice(None),) * self.axis + (slice(a, b),)
        return tuple(x[at] for x in arrays)

    def write(self, position: int, *arrays: mx.array) -> None:
        """Log `arrays` (equal lengths along ``axis``) as positions ``[position, position +
        len)``."""
        kept = [(s, self._cut(xs, 0, min(self._length(xs), position - s)))
                for s, xs in self.pieces if s < position]
        self.pieces = [*kept, (position, arrays)]

    def rows(self, start: int, end: int) -> tuple[mx.array, ...]:
        """The logged rows of positions ``[start, end)``, one array per array written.

        Raises:
            ValueError: some of those positions were never written.
        """
        parts = [self._cut(xs, max(s, start) - s, min(s + self._length(xs), end) - s)
                 for s, xs in self.pieces if s < end and s + self._length(xs) > start]
        if sum(self._length(p) for p in parts) != end - start:
            raise ValueError(f"rows [{start}, {end}) were not all written")
        columns = zip(*parts, strict=True)  # keys' parts, values' parts, ...
        return tuple(mx.concatenate(list(column), axis=self.axis) for column in columns)


class CommittedCache:
    """Bookkeeping every architecture's cache shares: commit after success, poison, reset,
    and the exact byte state.

    A chunk's life: `begin` (its graph is about to write the buffers), then `commit` once it
    evaluated, or `abandon` (its job ended with the chunk in flight: the buffers go back to
    the last commit, exactly). While a chunk is in flight nothing may leave the cache:
    `snapshot` and `state` raise `ChunkInFlight`.

    Subclasses set ``layers`` (each with ``reset()``), ``position``, ``context_length`` and
    ``_poisoned`` in ``__init__``, and define ``check_chunk(n_tokens)``, ``arrays()``,
    ``capacity``, ``buffers()``, ``layout()`` (the metadata `from_state` checks),
    ``_snapshot()`` and ``restore(snapshot)``.
    """

    layers: list
    position: int
    context_length: int
    _poisoned: bool
    # chunks begun and not committed, oldest first: (tokens, snapshot at the chunk's start)
    _in_flight: tuple[tuple[int, object], ...] = ()

    def __getitem__(self, i: int):
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def is_poisoned(self) -> bool:
        return self._poisoned

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers allocated now."""
        return sum(a.nbytes for a in self.arrays())

    @property
    def capacity(self) -> int:
        raise NotImplementedError

    def check_chunk(self, n_tokens: int) -> None:
        raise NotImplementedError

    def arrays(self) -> list[mx.array]:
        """Every buffer, for ``mx.eval`` after a chunk."""
        raise NotImplementedError

    def buffers(self) -> list[BufferView]:
        """Every buffer by blob name, with its row axis and rows per token (None: fixed)."""
        raise NotImplementedError

    def layout(self) -> dict:
        """Architecture, dtype and shapes: what must match for `from_state` to load."""
        raise NotImplementedError

    @property
    def in_flight(self) -> int:
        """Tokens of the chunks begun (`begin`) and not yet committed or abandoned."""
        return sum(n for n, _ in self._in_flight)

    def begin(self, n_tokens: int) -> None:
        """A chunk of `n_tokens` after those in flight is about to write the buffers.

        Keeps a rollback point for `abandon`: a snapshot at the chunk's start (references to
        the ring and recurrent-state arrays, which a chunk rewrites; MLX arrays are values,
        so this copies nothing, though the first write after it copies what it rewrites
        instead of updating it in place). Append-only rows need none: past the committed
        position they are dead.
        """
        self._in_flight = (*self._in_flight, (n_tokens, self._snapshot()))

    def commit(self, n_tokens: int) -> None:
        """Advance the position after a chunk of `n_tokens` completed and was evaluated.

        Raises:
            ValueError: chunks are in flight and the oldest is not of `n_tokens` tokens.
            CachePoisoned, ContextExhausted: as `check_chunk`.
        """
        if self._in_flight and self._in_flight[0][0] != n_tokens:
            raise ValueError(f"commit of {n_tokens} tokens, but the oldest chunk in flight "
                             f"has {self._in_flight[0][0]}")
        self.check_chunk(n_tokens)
        self.position += n_tokens
        self._in_flight = self._in_flight[1:]

    def abandon(self) -> None:
        """Drop every chunk in flight: the buffers are back at the last commit, exactly as
        before the oldest one began, so the cache may be kept (a session's slot) or saved.
        A poisoned cache stays poisoned (a failed chunk may have grown buffers in place).
        Does nothing when no chunk is in flight."""
        if not self._in_flight:
            return
        (_, snapshot), *_ = self._in_flight
        poisoned = self._poisoned
        try:
            self.restore(snapshot)
        except CacheError:  # a chunk in flight grew the cache: the old layout's point is gone
            poisoned = True
        self._poisoned, self._in_flight = poisoned, ()

    def snapshot(self):
        """Exact rollback point at the committed position (`restore` returns to it).

        Raises:
            CachePoisoned: the cache holds a half-written chunk.
            ChunkInFlight: a launched chunk's writes are in the buffers.
        """
        self._check_settled("snapshot")
        return self._snapshot()

    def _snapshot(self):
        raise NotImplementedError

    def restore(self, snapshot) -> None:
        raise NotImplementedError

    def _check_settled(self, what: str) -> None:
        if self._poisoned:
            raise CachePoisoned(f"cannot {what} a poisoned cache")
        if self._in_flight:
            raise ChunkInFlight(f"cannot {what} a cache with {self.in_flight} tokens in flight: "
                                f"commit or abandon them first")

    @contextmanager
    def ahead(self, n_tokens: int) -> Iterator[None]:
        """Inside, the position reads `n_tokens` further: the next chunk is built after a
        launched chunk of `n_tokens` that is not committed yet (`Prefill.run`'s two chunks in
        flight). The committed position is back on exit; `commit` advances it once the
        launched chunk has evaluated."""
        self.position += n_tokens
        try:
            yield
        finally:
            self.position -= n_tokens

    def poison(self) -> None:
        self._poisoned = True

    def reset(self) -> None:
        """Back to position 0 and unpoisoned; every layer re-initializes its state."""
        for layer in self.layers:
            layer.reset()
        self.position = 0
        self._poisoned, self._in_flight = False, ()

    def state(self, since: int = 0) -> CacheState:
        """The cache at ``position`` as named little-endian blobs plus metadata (exact).

        Append-only blobs hold rows ``[since // ratio, position // ratio)`` in rows-first
        layout, so the blobs of ``state(since=N)`` appended to those of a state at position
        N are a state at ``position`` (`CacheState.extend`); fixed blobs (rings, compressor
        state) are whole.

        Args:
            since: a committed position ``<= position`` (0 = a complete state).
        Raises:
            CachePoisoned: the cache holds a half-written chunk.
            ChunkInFlight: a launched chunk's writes are in the buffers.
        """
        self._check_settled("save the state of")
        assert 0 <= since <= self.position, f"since {since} outside [0, {self.position}]"
        meta = {"version": STATE_VERSION, **self.layout(), "position": self.position,
                "capacity": self.capacity, "context_length": self.context_length}
        return save_buffers(meta, self.buffers(), since, self.position)

    def load_state(self, state: CacheState) -> None:
        """Fill this freshly allocated cache from `state` (its layout already checked).

        Raises:
            CacheStateError: a blob is missing, extra, or of the wrong dtype, shape or size.
        """
        self.position = state.meta["position"]
        try:
            load_buffers(state, self.buffers(), self.position)
        except ValueError as e:
            raise CacheStateError(str(e)) from e
        mx.eval(self.arrays())
        self._poisoned, self._in_flight = False, ()


def check_layout(meta: dict, expected: dict) -> None:
    """Raise `CacheStateError` naming the first field of `meta` that differs from `expected`
    (the version first), or a position past the capacity."""
    for key, want in {"version": STATE_VERSION, **expected}.items():
        got = meta.get(key)
        if got != want:
            raise CacheStateError(f"cache state {key} is {got!r}, this cache needs {want!r}")
    position, capacity = meta.get("position"), meta.get("capacity")
    if not (isinstance(position, int) and isinstance(capacity, int) and 0 <= position <= capacity):
        raise CacheStateError(f"cache state position {position!r} outside [0, {capacity!r}]")


def kv_dtype_of(meta: dict) -> mx.Dtype:
    """The KV row dtype a state names. Raises CacheStateError for an unknown one."""
    name = meta.get("kv_dtype")
    if name not in DTYPES:
        raise CacheStateError(f"cache state kv_dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]

