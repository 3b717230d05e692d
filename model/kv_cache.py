"""KV caches of standard attention layers: append-only global rows and sliding-window rings.

`ModelCache` holds one per layer (Gemma 3: five sliding layers to one global) and follows
the `model.cache.CommittedCache` contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .cache import (
    CachePoisoned,
    CacheStateError,
    CommittedCache,
    ContextExhausted,
    RingBuffer,
    RowLog,
    check_layout,
    kv_dtype_of,
    window_mask,
)
from .cache_plan import CachePlan, LayerSpec, plan_cache
from .cache_state import BufferView, CacheState, dtype_name

# Global-attention buffers grow in steps of this many tokens (mlx-lm's KVCache step) when a
# caller did not reserve the exact capacity up front.
CAPACITY_STEP_TOKENS = 256


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
        self.write(k, v, position)
        end = position + k.shape[2]
        return self.keys[:, :, :end, :], self.values[:, :, :end, :], "causal"

    def write(self, k: mx.array, v: mx.array, position: int) -> None:
        """Write a chunk's rows ``(B, n_kv_heads, L, head_dim)`` at `position`, growing the
        buffers as needed, and read nothing back (`update` without its keys)."""
        end = position + k.shape[2]
        if end > self.capacity:
            steps = -(-end // CAPACITY_STEP_TOKENS)
            self._grow(steps * CAPACITY_STEP_TOKENS, position)
        self.keys[:, :, position:end, :] = k.astype(self.dtype)
        self.values[:, :, position:end, :] = v.astype(self.dtype)

    def arrays(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]

    def buffers(self, prefix: str) -> list[BufferView]:
        """Append-only: rows ``[0, position)`` along axis 2 hold data."""
        if self.keys is None:
            return []
        return [BufferView(f"{prefix}.keys", self.keys, 2, 1),
                BufferView(f"{prefix}.values", self.values, 2, 1)]

    def snapshot(self) -> None:
        return None  # append-only: restoring the position hides later rows

    def restore(self, snapshot: None) -> None:
        pass

    def reset(self) -> None:
        pass  # rows past position 0 are dead; nothing to clear

    def rows(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        """Keys and values of positions ``[start, end)``, ``(1, n_kv_heads, end - start,
        head_dim)`` each (views of the buffers; the caller checks the positions are
        committed)."""
        return self.keys[:, :, start:end, :], self.values[:, :, start:end, :]


class RingKVCache:
    """The last ``window`` K/V rows of a sliding-window layer, row ``p`` at slot ``p % window``.

    A chunk of L queries at position p attends to keys ``(p+i-window, p+i]`` (`window_mask`),
    so it needs the previous ``window - 1`` rows gathered in order plus its own L rows; the
    ring then keeps the newest ``window`` rows.
    """

    def __init__(self, spec: LayerSpec, dtype: mx.Dtype):
        assert spec.window, "RingKVCache needs a window"
        self.spec, self.dtype = spec, dtype
        shape = (1, spec.n_kv_heads, spec.window, spec.head_dim)
        self._k = RingBuffer(mx.zeros(shape, dtype), axis=2)
        self._v = RingBuffer(mx.zeros(shape, dtype), axis=2)
        self.log: RowLog | None = None  # every row written since `ModelCache.keep_rows`

    @property
    def keys(self) -> mx.array:
        return self._k.data

    @property
    def values(self) -> mx.array:
        return self._v.data

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
        keys = mx.concatenate([self._k.read(position - n_prev, position), k], axis=2)
        values = mx.concatenate([self._v.read(position - n_prev, position), v], axis=2)
        self.write(k, v, position)
        if L == 1:
            return keys, values, None
        if n_prev + L <= W:
            return keys, values, "causal"
        return keys, values, window_mask(position, L, position - n_prev, n_prev + L, W)

    def write(self, k: mx.array, v: mx.array, position: int) -> None:
        """Keep a chunk's rows ``(B, n_kv_heads, L, head_dim)`` at `position` (the newest
        ``window`` of them) and read nothing back (`update` without its keys)."""
        k, v = k.astype(self.dtype), v.astype(self.dtype)
        self._k.write(k, position)
        self._v.write(v, position)
        if self.log is not None:
            self.log.write(position, k, v)

    def rows(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        """Keys and values of positions ``[start, end)``, ``(1, n_kv_heads, end - start,
        head_dim)`` each, from the rows kept since `ModelCache.keep_rows`.

        Raises:
            ValueError: rows were not kept then (the ring holds only the window's).
        """
        if self.log is None:
            raise ValueError(f"rows [{start}, {end}) of a sliding layer were not kept "
                             "(ModelCache.keep_rows)")
        keys, values = self.log.rows(start, end)  # RowLog raises if some were never written
        return keys, values

    def arrays(self) -> list[mx.array]:
        return [self.keys, self.values]

    def buffers(self, prefix: str) -> list[BufferView]:
        """Rings: saved whole (slot order), ring axis 2."""
        return [BufferView(f"{prefix}.keys", self.keys, 2, None),
                BufferView(f"{prefix}.values", self.values, 2, None)]

    def snapshot(self) -> tuple[mx.array, mx.array]:
        return mx.array(self.keys), mx.array(self.values)

    def restore(self, snapshot: tuple[mx.array, mx.array]) -> None:
        self._k.data, self._v.data = mx.array(snapshot[0]), mx.array(snapshot[1])

    def reset(self) -> None:
        self._k.data = mx.zeros_like(self.keys)
        self._v.data = mx.zeros_like(self.values)


@dataclass(frozen=True)
class CacheSnapshot:
    """Rollback point: the position and, per layer, a ring copy (None for a global layer)."""

    position: int
    layers: tuple

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for saved in self.layers if saved is not None for a in saved)


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
        architecture: the model's name, recorded in `state` and checked by `from_state`.
        capacity_step: tokens a caller's explicit `grow` steps by (recorded for sessions;
            growth inside a forward pass always steps by ``CAPACITY_STEP_TOKENS``).
    """

    def __init__(
        self,
        specs: list[LayerSpec],
        context_length: int,
        kv_dtype: mx.Dtype = mx.float32,
        capacity: int = 0,
        architecture: str = "",
        capacity_step: int = CAPACITY_STEP_TOKENS,
    ):
        self.specs, self.context_length, self.kv_dtype = list(specs), context_length, kv_dtype
        self.architecture, self.capacity_step = architecture, capacity_step
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

    def arrays(self) -> list[mx.array]:
        """Every buffer, for ``mx.eval`` after a chunk."""
        return [a for layer in self.layers for a in layer.arrays()]

    def buffers(self) -> list[BufferView]:
        return [b for i, layer in enumerate(self.layers) for b in layer.buffers(f"layers.{i}")]

    def layout(self) -> dict:
        return {
            "cache": type(self).__name__,
            "architecture": self.architecture,
            "kv_dtype": dtype_name(self.kv_dtype),
            "layers": [[s.n_kv_heads, s.head_dim, s.window] for s in self.specs],
        }

    def keep_rows(self) -> None:
        """From now on keep every row the sliding layers write, not only their window's, so
        that `rows` can return any committed position's (a prefix cache's capture,
        `model.prefix_cache`). Costs what the global layers cost: each sliding layer's keys
        and values for every token written, until the cache is dropped."""
        for layer in self.layers:
            if isinstance(layer, RingKVCache) and layer.log is None:
                layer.log = RowLog(axis=2)

    def rows(self, start: int, end: int) -> list[tuple[mx.array, mx.array]]:
        """Every layer's keys and values of positions ``[start, end)``, ``(1, n_kv_heads,
        end - start, head_dim)`` each (lazy; views of the buffers or the kept rows).

        Raises:
            ValueError: the range is empty or past the committed position, or a sliding
                layer did not keep those rows (`keep_rows` was off when they were written).
        """
        if not 0 <= start < end <= self.position:
            raise ValueError(f"rows [{start}, {end}) are not committed rows of a cache at "
                             f"{self.position}")
        return [layer.rows(start, end) for layer in self.layers]

    @classmethod
    def from_state(
        cls, specs: list[LayerSpec], state: CacheState, architecture: str = ""
    ) -> ModelCache:
        """A new cache equal to the one `state` was saved from.

        Args:
            specs: the model's layer specs; the state must have been saved with them.
            architecture: the model's name, which the state must name.
        Raises:
            CacheStateError: another version, architecture, dtype, layer shapes, a position
                past the capacity, or a blob missing or of the wrong dtype, shape or size.
        """
        meta = state.meta
        kv_dtype = kv_dtype_of(meta)
        context_length = meta.get("context_length")
        if not isinstance(context_length, int) or context_length < 1:
            raise CacheStateError(f"cache state context_length {context_length!r} is not positive")
        cache = cls(specs, context_length, kv_dtype, architecture=architecture)
        check_layout(meta, cache.layout())
        # growth allocates whole steps, so a grown capacity may pass the context by < 1 step
        limit = -(-cache.context_length // CAPACITY_STEP_TOKENS) * CAPACITY_STEP_TOKENS
        if not 0 <= meta["capacity"] <= max(limit, cache.context_length):
            raise CacheStateError(f"cache state capacity {meta['capacity']} outside the context")
        for layer in cache.layers:
            if isinstance(layer, GlobalKVCache) and meta["capacity"]:
                layer._grow(meta["capacity"], 0)
        cache.load_state(state)
        return cache

    def _snapshot(self) -> CacheSnapshot:
        # `snapshot`: the ring layers' arrays (values), nothing for append-only layers
        return CacheSnapshot(self.position, tuple(layer.snapshot() for layer in self.layers))

    def restore(self, snapshot: CacheSnapshot) -> None:
        """Return to `snapshot`; append-only rows past its position become dead, and chunks
        in flight are dropped."""
        for layer, saved in zip(self.layers, snapshot.layers, strict=True):
            layer.restore(saved)
        self.position = snapshot.position
        self._poisoned, self._in_flight = False, ()

    def grow(self, capacity: int, snapshot: CacheSnapshot | None = None) -> CacheSnapshot | None:
        """Reallocate the global layers for `capacity` tokens, migrating the live prefix
        (rows ``[0, position)``); rings keep their fixed size. No reset.

        Returns `snapshot` (a rollback point of this cache at or before ``position``), which
        stays valid: its global rows are below the position and were migrated.

        Raises:
            CachePoisoned: the cache holds a half-written chunk.
            ChunkInFlight: a launched chunk's rows past the position would not migrate.
            ValueError: `capacity` is not above the current capacity or past the context, or
                `snapshot` is ahead of the position.
        """
        self._check_settled("grow")
        if not self.capacity < capacity <= self.context_length:
            raise ValueError(f"cannot grow a cache of {self.capacity} tokens to {capacity} "
                             f"(context {self.context_length})")
        if snapshot is not None and snapshot.position > self.position:
            raise ValueError(f"snapshot at {snapshot.position} is ahead of the cache's "
                             f"{self.position}")
        for layer in self.layers:
            if isinstance(layer, GlobalKVCache):
                layer._grow(capacity, self.position)
        mx.eval(self.arrays())
        return snapshot


class KVCacheModel:
    """`make_cache` and `cache_from_state` of an architecture's ``Model``: a mixin for one
    with ``args.layer_specs()``, ``args.context_length`` and an ``architecture`` name
    (recorded in each state, checked on load). A model whose cache is another type (DeepSeek
    V4's) overrides `empty_cache` and `cache_from_state`."""

    args: object
    architecture: str

    def make_cache(
        self,
        kv_dtype: mx.Dtype = mx.float32,
        capacity: int = 0,
        context_length: int = 0,
        capacity_step: int | None = None,
    ) -> ModelCache:
        """An empty cache: `capacity` tokens reserved, `context_length` (default the model's)
        at most, growing by `capacity_step` (default the cache type's)."""
        return self.empty_cache(kv_dtype, capacity, context_length or self.args.context_length,
                                capacity_step)

    def empty_cache(self, kv_dtype: mx.Dtype, capacity: int, context_length: int,
                    capacity_step: int | None) -> ModelCache:
        """`make_cache`'s cache, its context given (`capacity_step` default
        ``CAPACITY_STEP_TOKENS``)."""
        return ModelCache(self.args.layer_specs(), context_length, kv_dtype, capacity,
                          self.architecture, capacity_step or CAPACITY_STEP_TOKENS)

    def cache_from_state(self, state: CacheState) -> ModelCache:
        """The cache `state` was saved from (`ModelCache.from_state`; raises CacheStateError)."""
        return ModelCache.from_state(self.args.layer_specs(), state, self.architecture)
