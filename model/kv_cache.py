"""A model's KV cache: one layer cache per attention layer (`model.layer_cache`: append-only
global rows and sliding-window rings; Gemma 3: five sliding layers to one global) and the
committed position, following the `model.cache.CommittedCache` contract.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import mlx.core as mx

from .cache import (
    CachePoisoned,
    CacheStateError,
    CommittedCache,
    ContextExhausted,
    RowLog,
    check_layout,
    kv_dtype_of,
)
from .cache_plan import CachePlan, LayerSpec, plan_cache
from .cache_state import BufferView, CacheState, dtype_name
from .layer_cache import CAPACITY_STEP_TOKENS, GlobalKVCache, RingKVCache


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

    def fork(self) -> ModelCache:
        """A second cache at the committed position holding the same rows, shared as MLX
        values: prefilling either leaves the other as it was, and only the layers a chunk
        rewrites are copied, on its first write (`model.continuations` prefills each
        continuation of one context from a fork of its cache). The sliding layers' kept
        rows (`keep_rows`) stay with this cache.

        Raises:
            CachePoisoned: the cache holds a half-written chunk.
            ChunkInFlight: a launched chunk's writes are in the buffers.
        """
        self._check_settled("fork")
        twin = copy.copy(self)
        twin.layers = [layer.fork() for layer in self.layers]
        twin._in_flight = ()
        return twin

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
