"""KV caches for chunked prefill: per-layer buffers plus one committed position.

The contract follows hf2q's ``Deepseek4Cache`` (seeds 004), generalized to every
architecture:

- a layer writes a chunk's keys/values at the cache's committed ``position`` but the
  position only advances in ``commit`` after the whole chunk has been evaluated, so a chunk
  that raises leaves the cache ``poisoned`` (rows past ``position`` may be half written);
- append-only layers (global attention) need no copy to snapshot: restoring ``position``
  hides later rows; ring layers (sliding window) are copied;
- ``plan`` is pure arithmetic over the architecture's layer shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

# Global-attention buffers grow in steps of this many tokens (mlx-lm's KVCache step) when a
# caller did not reserve the exact capacity up front.
CAPACITY_STEP_TOKENS = 256


class CacheError(RuntimeError):
    """Base class of cache errors."""


class CachePoisoned(CacheError):
    """A chunk failed part-way; the cache must be ``reset()`` before further use."""


class ContextExhausted(CacheError):
    """A chunk would write past the cache's context length."""


_DTYPE_BYTES = {mx.float32: 4, mx.float16: 2, mx.bfloat16: 2}


def dtype_bytes(dtype: mx.Dtype) -> int:
    return _DTYPE_BYTES[dtype]


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


class GlobalKVCache:
    """Append-only K/V rows for a global-attention layer, shape ``(B, n_kv_heads, T, head_dim)``."""

    def __init__(self, spec: LayerSpec, dtype: mx.Dtype, capacity: int = 0):
        self.spec, self.dtype = spec, dtype
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        if capacity:
            self._grow(capacity, 0)

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def _grow(self, capacity: int, live: int) -> None:
        shape = (1, self.spec.n_kv_heads, capacity, self.spec.head_dim)
        keys, values = mx.zeros(shape, self.dtype), mx.zeros(shape, self.dtype)
        if live:  # migrate the live prefix; rows past it are dead
            keys[:, :, :live, :] = self.keys[:, :, :live, :]
            values[:, :, :live, :] = self.values[:, :, :live, :]
        self.keys, self.values = keys, values

    def update(self, k: mx.array, v: mx.array, position: int) -> tuple[mx.array, mx.array, str]:
        """Write a chunk at `position`; return all keys/values ``[0, position + L)`` and the mask.

        Args:
            k, v: ``(B, n_kv_heads, L, head_dim)``.
        Returns:
            keys, values of shape ``(B, n_kv_heads, position + L, head_dim)`` and the mask
            ``"causal"`` (MLX aligns it to the last key, i.e. query i sits at position + i).
        """
        L = k.shape[2]
        end = position + L
        if end > self.capacity:
            steps = -(-end // CAPACITY_STEP_TOKENS)
            self._grow(steps * CAPACITY_STEP_TOKENS, position)
        self.keys[:, :, position:end, :] = k.astype(self.dtype)
        self.values[:, :, position:end, :] = v.astype(self.dtype)
        return self.keys[:, :, :end, :], self.values[:, :, :end, :], "causal"

    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]

    def snapshot(self) -> None:
        return None  # append-only: restoring the position hides later rows

    def restore(self, snapshot: None) -> None:
        pass

    def reset(self) -> None:
        pass  # rows past position 0 are dead; nothing to clear


class RingKVCache:
    """The last ``window`` K/V rows of a sliding-window layer, row ``p`` at slot ``p % window``.

    A chunk of L queries at position p attends to keys ``(p+i-window, p+i]`` (HF Gemma 3:
    ``q_idx - kv_idx < sliding_window``), so it needs the previous ``window - 1`` rows
    gathered in order plus its own L rows; the ring then keeps the newest ``window`` rows.
    """

    def __init__(self, spec: LayerSpec, dtype: mx.Dtype):
        assert spec.window, "RingKVCache needs a window"
        self.spec, self.dtype = spec, dtype
        shape = (1, spec.n_kv_heads, spec.window, spec.head_dim)
        self.keys, self.values = mx.zeros(shape, dtype), mx.zeros(shape, dtype)

    def _in_order(self, buf: mx.array, start: int, stop: int) -> mx.array:
        """Rows for positions ``[start, stop)`` (at most `window` of them), oldest first."""
        W = self.spec.window
        a, b = start % W, stop % W
        if stop - start == 0:
            return buf[:, :, :0, :]
        if a < b:
            return buf[:, :, a:b, :]
        return mx.concatenate([buf[:, :, a:, :], buf[:, :, :b, :]], axis=2)

    def _write(self, buf: mx.array, rows: mx.array, start: int) -> None:
        W = self.spec.window
        n = rows.shape[2]
        a = start % W
        first = min(n, W - a)
        buf[:, :, a : a + first, :] = rows[:, :, :first, :]
        if first < n:
            buf[:, :, : n - first, :] = rows[:, :, first:, :]

    def update(
        self, k: mx.array, v: mx.array, position: int
    ) -> tuple[mx.array, mx.array, mx.array | str | None]:
        """Attend-to keys/values for a chunk at `position`, then keep the newest rows.

        Args:
            k, v: ``(B, n_kv_heads, L, head_dim)``.
        Returns:
            keys, values of shape ``(B, n_kv_heads, n_prev + L, head_dim)`` with
            ``n_prev = min(position, window - 1)``, and a boolean mask ``(L, n_prev + L)``
            (True = attend), ``"causal"`` when the window cannot bind, or None for L == 1.
        """
        W, L = self.spec.window, k.shape[2]
        k, v = k.astype(self.dtype), v.astype(self.dtype)
        n_prev = min(position, W - 1)
        keys = mx.concatenate([self._in_order(self.keys, position - n_prev, position), k], axis=2)
        values = mx.concatenate(
            [self._in_order(self.values, position - n_prev, position), v], axis=2
        )
        keep = min(L, W)
        self._write(self.keys, k[:, :, L - keep :, :], position + L - keep)
        self._write(self.values, v[:, :, L - keep :, :], position + L - keep)
        if L == 1:
            return keys, values, None
        if n_prev + L <= W:
            return keys, values, "causal"
        q_pos = mx.arange(position, position + L)[:, None]
        k_pos = mx.arange(position - n_prev, position + L)[None, :]
        return keys, values, (k_pos <= q_pos) & (q_pos - k_pos < W)

    def state(self) -> list[mx.array]:
        return [self.keys, self.values]

    def snapshot(self) -> tuple[mx.array, mx.array]:
        return mx.array(self.keys), mx.array(self.values)

    def restore(self, snapshot: tuple[mx.array, mx.array]) -> None:
        self.keys, self.values = mx.array(snapshot[0]), mx.array(snapshot[1])

    def reset(self) -> None:
        self.keys = mx.zeros_like(self.keys)
        self.values = mx.zeros_like(self.values)


@dataclass(frozen=True)
class CacheSnapshot:
    position: int
    layers: tuple


class CommittedCache:
    """Bookkeeping every architecture's cache shares (seeds 004: commit after success).

    Subclasses set ``layers`` (each with ``reset()``), ``position`` and ``_poisoned`` in
    ``__init__``, and define ``check_chunk(n_tokens)`` and ``state()``.
    """

    layers: list
    position: int
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
        return sum(a.nbytes for a in self.state())

    def check_chunk(self, n_tokens: int) -> None:
        raise NotImplementedError

    def state(self) -> list[mx.array]:
        raise NotImplementedError

    def commit(self, n_tokens: int) -> None:
        """Advance the position after a chunk of `n_tokens` completed and was evaluated."""
        self.check_chunk(n_tokens)
        self.position += n_tokens

    def poison(self) -> None:
        self._poisoned = True

    def reset(self) -> None:
        """Back to position 0 and unpoisoned; every layer re-initializes its state."""
        for layer in self.layers:
            layer.reset()
        self.position = 0
        self._poisoned = False


class ModelCache(CommittedCache):
    """One job's KV cache: a layer cache per attention layer and the committed position.

    The committed ``position`` is the prefill cursor: tokens ``[0, position)`` are in the
    cache. Layers write at ``position`` during a forward pass; ``commit(n)`` advances it
    once the chunk's arrays are evaluated.

    Args:
        specs: one `LayerSpec` per layer.
        context_length: the most tokens this cache may hold.
        kv_dtype: row dtype (float32 on CPU, bfloat16/float16 on GPU).
        capacity: tokens to reserve in global layers now (grows on demand past it).
    """

    def __init__(
        self,
        specs: list[LayerSpec],
        context_length: int,
        kv_dtype: mx.Dtype = mx.float32,
        capacity: int = 0,
    ):
        self.specs, self.context_length, self.kv_dtype = list(specs), context_length, kv_dtype
        capacity = min(capacity, context_length)
        self.layers = [
            GlobalKVCache(s, kv_dtype, capacity) if s.window is None else RingKVCache(s, kv_dtype)
            for s in self.specs
        ]
        self.position = 0
        self._poisoned = False

    @property
    def capacity(self) -> int:
        """Tokens the global buffers hold without growing (context length if none)."""
        caps = [layer.capacity for layer in self.layers if isinstance(layer, GlobalKVCache)]
        return min(caps) if caps else self.context_length

    def plan(self, context_length: int | None = None) -> CachePlan:
        return plan_cache(self.specs, context_length or self.context_length, self.kv_dtype)

    def check_chunk(self, n_tokens: int) -> None:
        """Raise before a forward pass that must not run: poisoned cache or too many tokens."""
        if self._poisoned:
            raise CachePoisoned("cache was poisoned by a failed chunk; reset() it first")
        if self.position + n_tokens > self.context_length:
            raise ContextExhausted(
                f"chunk of {n_tokens} tokens at position {self.position} exceeds the "
                f"context length {self.context_length}"
            )

    def state(self) -> list[mx.array]:
        """Every buffer, for ``mx.eval`` after a chunk."""
        return [a for layer in self.layers for a in layer.state()]

    def snapshot(self) -> CacheSnapshot:
        """Exact rollback point at the current position (copies only ring layers)."""
        if self._poisoned:
            raise CachePoisoned("cannot snapshot a poisoned cache")
        return CacheSnapshot(self.position, tuple(layer.snapshot() for layer in self.layers))

    def restore(self, snapshot: CacheSnapshot) -> None:
        """Return to `snapshot`; append-only rows past its position become dead."""
        for layer, saved in zip(self.layers, snapshot.layers, strict=True):
            layer.restore(saved)
        self.position = snapshot.position
        self._poisoned = False
