"""The KV cache contract every architecture's cache follows, its ring and window mask.

- A layer writes a chunk's rows at the committed ``position``; ``commit`` advances it only
  after the chunk was evaluated, so a chunk that raises leaves the cache ``poisoned``.
- Append-only buffers need no copy to snapshot (restoring ``position`` hides later rows);
  rings (`RingBuffer`) are copied.
- ``state()`` / ``from_state()`` turn a cache into named little-endian blobs plus a
  msgpack/JSON-able dict and back, exactly (`CommittedCache.state`, `model.cache_state`).
- ``plan_cache`` is pure arithmetic over an architecture's layer shapes.

The caches: `model.kv_cache.ModelCache` (global and sliding-window layers, Gemma 3) and
`model.archs.deepseek4.cache.Deepseek4Cache`.
The commit-after-success contract follows hf2q's ``Deepseek4Cache``
(github.com/robertelee78/hf2q, ``src/inference/models/deepseek4``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx

from .cache_state import (
    DTYPES,
    STATE_VERSION,
    BufferView,
    CacheState,
    dtype_bytes,
    load_buffers,
    save_buffers,
)

# hf2q grows a serving cache in steps of this many tokens (its ``INITIAL_CACHE_LENGTH``).
SERVING_CAPACITY_STEP_TOKENS = 131_072


def cache_capacity_for_request(
    serving_context: int,
    current_capacity: int,
    prompt_tokens: int,
    max_tokens: int = 1,
    step: int = SERVING_CAPACITY_STEP_TOKENS,
) -> int:
    """Tokens of cache a request needs: `current_capacity` if ``prompt_tokens + max_tokens - 1``
    fits in it, else that need rounded up to a multiple of `step`, capped at `serving_context`.

    Source: hf2q ``cache_capacity_for_request`` (seed ``000_5548d34d07140090``), with its
    131,072-token step made a parameter so small caches can grow in small steps.

    Raises:
        ValueError: `step` < 1.
    """
    if step < 1:
        raise ValueError(f"capacity step must be >= 1 token, got {step}")
    required = min(prompt_tokens + max(max_tokens, 1) - 1, serving_context)
    if required <= current_capacity:
        return current_capacity
    return min(-(-required // step) * step, serving_context)


class CacheError(RuntimeError):
    """Base class of cache errors."""


class CachePoisoned(CacheError):
    """A chunk failed part-way; the cache must be ``reset()`` before further use."""


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


@dataclass(frozen=True)
class LayerSpec:
    """Shape of one attention layer's cache.

    Attributes:
        n_kv_heads: KV heads.
        head_dim: width of one key (and value) row.
        window: sliding-window length in tokens, or None for global attention.
    """

    n_kv_heads: int
    head_dim: int
    window: int | None = None


@dataclass(frozen=True)
class LayerPlan:
    kind: str  # "global" (append-only) or "window" (ring)
    rows: int
    row_bytes: int

    @property
    def bytes(self) -> int:
        return self.rows * self.row_bytes


@dataclass(frozen=True)
class CachePlan:
    """Byte accounting of a cache for `context_length` tokens.

    Attributes:
        layers: per-layer rows and bytes (K and V together).
        bytes_per_token: context-linear bytes per token (append-only layers).
        fixed_bytes: bytes that do not grow with context (ring windows once full).
        resident_bytes: total bytes of all buffers at `context_length`.
    """

    context_length: int
    kv_dtype: str
    layers: tuple[LayerPlan, ...]
    bytes_per_token: int
    fixed_bytes: int

    @property
    def resident_bytes(self) -> int:
        return sum(layer.bytes for layer in self.layers)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def describe_layers(self) -> list[str]:
        """One line per layer, e.g. ``layer  0: sliding 512 rows x 2048 B``."""
        return [
            f"layer {i:>2}: {layer.kind} {layer.rows} rows x {layer.row_bytes} B"
            for i, layer in enumerate(self.layers)
        ]


def plan_cache(specs: list[LayerSpec], context_length: int, kv_dtype: mx.Dtype) -> CachePlan:
    """Plan buffers for `specs` at `context_length` tokens of `kv_dtype` rows (pure)."""
    item = dtype_bytes(kv_dtype)
    layers, per_token, fixed = [], 0, 0
    for spec in specs:
        row_bytes = 2 * spec.n_kv_heads * spec.head_dim * item  # K and V
        if spec.window is None:
            layers.append(LayerPlan("global", context_length, row_bytes))
            per_token += row_bytes
        else:
            rows = min(context_length, spec.window)
            layers.append(LayerPlan("window", rows, row_bytes))
            fixed += spec.window * row_bytes
    return CachePlan(context_length, str(kv_dtype), tuple(layers), per_token, fixed)


class CommittedCache:
    """Bookkeeping every architecture's cache shares: commit after success, poison, reset,
    and the exact byte state.

    Subclasses set ``layers`` (each with ``reset()``), ``position``, ``context_length`` and
    ``_poisoned`` in ``__init__``, and define ``check_chunk(n_tokens)``, ``arrays()``,
    ``capacity``, ``buffers()`` and ``layout()`` (the metadata `from_state` checks).
    """

    layers: list
    position: int
    context_length: int
    _poisoned: bool

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

    def commit(self, n_tokens: int) -> None:
        """Advance the position after a chunk of `n_tokens` completed and was evaluated."""
        self.check_chunk(n_tokens)
        self.position += n_tokens

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
        self._poisoned = False

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
        """
        if self._poisoned:
            raise CachePoisoned("cannot save the state of a poisoned cache")
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
        self._poisoned = False


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

