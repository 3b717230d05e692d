"""DeepSeek-V4 KV cache: circular window, compressed rows, indexer rows, compressor state.

Buffers as `model.archs.deepseek4.planning` lays them out; the committed ``position`` is the
prefill cursor and advances only after a chunk was evaluated (`model.cache.CommittedCache`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ... import cache as base
from ...cache_plan import cache_capacity_for_request
from ...cache_state import BufferView, CacheState, dtype_name
from .planning import (
    ARCHITECTURE,
    INITIAL_CACHE_LENGTH,
    STATE_DTYPE,
    STATE_KINDS,
    CompressionRatio,
    Deepseek4CacheError,
    Deepseek4CachePlan,
    LayerCachePlan,
    SlidingWindow,
    plan,
    plan_dtype,
)


class Accounting(Deepseek4CacheError):
    """Allocated bytes differ from the plan's."""


class SnapshotPlanMismatch(Deepseek4CacheError):
    """A snapshot was taken from a cache with another plan."""


class MigrationContext(Deepseek4CacheError):
    """Growth needs a strictly larger target context."""


class MigrationLayerCount(Deepseek4CacheError):
    """Growth between caches with different layer counts."""


class MigrationPlanMismatch(Deepseek4CacheError):
    """A target buffer is not prefix-compatible with the source's."""


class MigrationSnapshotPlanMismatch(Deepseek4CacheError):
    """The snapshot carried through growth is not from the source cache."""


class MigrationSnapshotPosition(Deepseek4CacheError):
    """The snapshot carried through growth is ahead of the source's position."""


class LayerCache:
    """One layer's buffers (attributes named after the plan's buffer kinds, None if absent);
    ``window`` is the data of ``ring``, a `model.cache.RingBuffer` over axis 0.

    The ring's row of position ``p`` sits at slot ``p % rows`` (overwritten: snapshots copy
    it); compressed and indexer rows are append-only (a restored position hides later rows).
    Slots ``[0, r)`` of an overlapping compressor's state hold the previous complete window,
    the current window's remainder tokens sit at slot ``off + t % r`` (``off = r`` if
    overlapping else 0), as in the DeepSeek-V4 reference ``inference/model.py``
    ``Compressor`` decode state."""

    def __init__(self, layer_plan: LayerCachePlan):
        self.plan = layer_plan
        self.ratio = layer_plan.compress_ratio
        self.ring = base.RingBuffer(mx.zeros((0,)))
        self.compressed = self.indexer = None
        self.main_kv_state = self.main_score_state = None
        self.indexer_kv_state = self.indexer_score_state = None
        for b in layer_plan.buffers:
            setattr(self, b.kind, mx.zeros(b.shape, plan_dtype(b.dtype)))
        self.reset()

    def reset(self) -> None:
        """Compressor state back to its start: kv 0, score -inf (no previous window)."""
        for kind in STATE_KINDS:
            buf = getattr(self, kind)
            if buf is not None:
                fill = -mx.inf if "score" in kind else 0.0
                setattr(self, kind, mx.full(buf.shape, fill, dtype=STATE_DTYPE))

    def arrays(self) -> list[mx.array]:
        return [getattr(self, b.kind) for b in self.plan.buffers]

    @property
    def window(self) -> mx.array:
        return self.ring.data

    @window.setter
    def window(self, data: mx.array) -> None:
        self.ring.data = data

    def buffers(self, prefix: str) -> list[BufferView]:
        """The window ring and compressor state whole; compressed/indexer rows append-only."""
        out = []
        for b in self.plan.buffers:
            ratio = self.ratio if b.kind in ("compressed", "indexer") else None
            out.append(BufferView(f"{prefix}.{b.kind}", getattr(self, b.kind), 0, ratio))
        return out


@dataclass(frozen=True)
class Deepseek4CacheSnapshot:
    """Exact rollback state at a token boundary: copies of rings and compressor state only."""

    plan: Deepseek4CachePlan
    position: int
    layers: tuple[dict[str, mx.array], ...]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for layer in self.layers for a in layer.values())


_COPIED_KINDS = ("window",) + STATE_KINDS


class Deepseek4Cache(base.CommittedCache):
    """One job's DeepSeek-V4 cache (the `model.kv_cache.ModelCache` interface).

    ``capacity_step``: tokens the capacity grows by
    (`model.cache_plan.cache_capacity_for_request`).

    Args:
        args: the model's `deepseek4.ModelArgs`.
        cache_plan: from `plan` for this model; its context is the allocated capacity.
        context_length: serving bound the cache may grow to (default: the plan's).
    Raises:
        SlidingWindow, LayerCount, CompressionRatio: the plan is not for this model.
        Accounting: allocated bytes differ from the plan's.
    """

    def __init__(self, args: Any, cache_plan: Deepseek4CachePlan, context_length: int = 0):
        if cache_plan.window != args.sliding_window:
            raise SlidingWindow(
                f"cache plan has a {cache_plan.window}-token window, the model "
                f"{args.sliding_window}"
            )
        ratios = [layer.compress_ratio for layer in cache_plan.layers]
        if ratios != list(args.compress_ratios):
            raise CompressionRatio(f"cache plan ratios {ratios} differ from the model's")
        self.args, self._plan = args, cache_plan
        self.context_length = max(context_length, cache_plan.context_length)
        self.layers = [LayerCache(lp) for lp in cache_plan.layers]
        if self.nbytes != cache_plan.resident_bytes:
            raise Accounting(f"planned {cache_plan.resident_bytes} bytes, got {self.nbytes}")
        self.position = 0
        self._poisoned = False
        self.capacity_step = INITIAL_CACHE_LENGTH

    @classmethod
    def for_model(
        cls,
        args: Any,
        kv_dtype: mx.Dtype,
        capacity: int = 0,
        context_length: int = 0,
        capacity_step: int | None = None,
    ) -> Deepseek4Cache:
        """A cache reserving `capacity` tokens now, at least one step (``capacity_step``
        tokens, default ``INITIAL_CACHE_LENGTH``), grown in such steps up to `context_length`."""
        ctx = context_length or args.context_length
        step = capacity_step or INITIAL_CACHE_LENGTH
        cap = cache_capacity_for_request(ctx, min(ctx, step), max(capacity, 1), 1, step)
        cache = cls(args, plan(args, cap, kv_dtype), ctx)
        cache.capacity_step = step
        return cache

    @property
    def capacity(self) -> int:
        return self._plan.context_length

    def plan(self, context_length: int | None = None) -> Deepseek4CachePlan:
        if context_length is None:
            return self._plan
        return plan(self.args, context_length, plan_dtype(self._plan.kv_dtype))

    @property
    def kv_dtype(self) -> mx.Dtype:
        return plan_dtype(self._plan.kv_dtype)

    def arrays(self) -> list[mx.array]:
        """Every buffer, for ``mx.eval`` after a chunk."""
        return [a for layer in self.layers for a in layer.arrays()]

    def buffers(self) -> list[BufferView]:
        return [b for i, layer in enumerate(self.layers) for b in layer.buffers(f"layers.{i}")]

    def layout(self) -> dict:
        a = self.args
        return {
            "cache": type(self).__name__,
            "architecture": ARCHITECTURE,
            "kv_dtype": dtype_name(self.kv_dtype),
            "window": a.sliding_window,
            "compress_ratios": list(a.compress_ratios),
            "head_dim": a.head_dim,
            "index_head_dim": a.index_head_dim,
        }

    @classmethod
    def from_state(cls, args: Any, state: CacheState) -> Deepseek4Cache:
        """A new cache equal to the one `state` was saved from, for the model of `args`.

        Raises:
            CacheStateError: another version, architecture, dtype, schedule or shapes, a
                capacity this model cannot plan, or a blob of the wrong dtype, shape or size.
        """
        meta = state.meta
        kv_dtype, capacity = base.kv_dtype_of(meta), meta.get("capacity")
        context_length = meta.get("context_length")
        if not isinstance(capacity, int) or not isinstance(context_length, int):
            raise base.CacheStateError("cache state has no integer capacity and context_length")
        try:
            cache = cls(args, plan(args, capacity, kv_dtype), context_length)
        except Deepseek4CacheError as e:
            raise base.CacheStateError(f"cache state does not fit this model: {e}") from e
        base.check_layout(meta, {**cache.layout(), "context_length": cache.context_length})
        cache.load_state(state)
        return cache

    def check_chunk(self, n_tokens: int) -> None:
        """Raise before a forward pass that must not run; grow the capacity if it must.

        Raises:
            CachePoisoned: a chunk failed earlier. ContextExhausted: past the serving context.
        """
        if self._poisoned:
            raise base.CachePoisoned(
                "DeepSeek-V4 cache is poisoned by a partial chunk; reset and replay"
            )
        end = self.position + n_tokens
        if end > self.context_length:
            raise base.ContextExhausted(
                f"chunk of {n_tokens} tokens at position {self.position} exceeds the "
                f"context length {self.context_length}"
            )
        if end > self.capacity:
            self.grow(cache_capacity_for_request(self.context_length, self.capacity, end, 1,
                                                 self.capacity_step))

    def commit(self, n_tokens: int) -> None:
        """Advance the position after a chunk of `n_tokens` completed and was evaluated."""
        if self.position + n_tokens > self.capacity:
            raise base.ContextExhausted(f"DeepSeek-V4 cache is full at {self.capacity} tokens")
        super().commit(n_tokens)

    def _snapshot(self) -> Deepseek4CacheSnapshot:
        # `snapshot`: the rings' and compressor state's arrays (values; a later write copies)
        layers = tuple(
            {k: mx.array(getattr(layer, k)) for k in _COPIED_KINDS if getattr(layer, k) is not None}
            for layer in self.layers
        )
        return Deepseek4CacheSnapshot(self._plan, self.position, layers)

    def restore(self, snapshot: Deepseek4CacheSnapshot) -> None:
        """Return to `snapshot`; compressed/indexer rows past its position become dead.

        Raises:
            SnapshotPlanMismatch: the snapshot is from a cache with another plan.
        """
        if snapshot.plan != self._plan or len(snapshot.layers) != len(self.layers):
            raise SnapshotPlanMismatch("DeepSeek-V4 snapshot does not match the live cache plan")
        for layer, saved in zip(self.layers, snapshot.layers, strict=True):
            for kind, array in saved.items():
                setattr(layer, kind, mx.array(array))
        self.position = snapshot.position
        self._poisoned, self._in_flight = False, ()

    def migrate_from(
        self, source: Deepseek4Cache, snapshot: Deepseek4CacheSnapshot | None = None
    ) -> Deepseek4CacheSnapshot | None:
        """Copy `source`'s live prefix into this larger cache; `source` is never modified.

        Nothing in this cache changes unless every check passes. Returns `snapshot` rebound to
        this cache's plan (so a turn anchor survives growth), or None.

        Raises:
            CachePoisoned, MigrationContext, MigrationLayerCount, MigrationPlanMismatch,
            MigrationSnapshotPlanMismatch, MigrationSnapshotPosition.
        """
        if source.is_poisoned:
            raise base.CachePoisoned("cannot migrate from a poisoned DeepSeek-V4 cache")
        _validate_growth(source._plan, self._plan)
        if snapshot is not None:
            if snapshot.plan != source._plan:
                raise MigrationSnapshotPlanMismatch("growth snapshot is not from the source cache")
            if snapshot.position > source.position:
                raise MigrationSnapshotPosition(
                    f"snapshot position {snapshot.position} exceeds source {source.position}"
                )
        pos, staged = source.position, []
        for src, dst in zip(source.layers, self.layers, strict=True):
            arrays = {k: getattr(src, k) for k in STATE_KINDS if getattr(src, k) is not None}
            n_win = min(pos, src.window.shape[0])  # slots == positions until the ring wraps
            arrays["window"] = _with_prefix(dst.window, src.window, n_win)
            for kind in ("compressed", "indexer"):
                if getattr(src, kind) is not None:  # append-only: rows of completed groups
                    rows = pos // src.ratio
                    arrays[kind] = _with_prefix(getattr(dst, kind), getattr(src, kind), rows)
            staged.append(arrays)
        mx.eval([a for arrays in staged for a in arrays.values()])
        for dst, arrays in zip(self.layers, staged, strict=True):
            for kind, array in arrays.items():
                setattr(dst, kind, mx.array(array))
        self.position, self._poisoned = pos, False
        if snapshot is None:
            return None
        return Deepseek4CacheSnapshot(self._plan, snapshot.position, snapshot.layers)

    def grow(
        self, capacity: int, snapshot: Deepseek4CacheSnapshot | None = None
    ) -> Deepseek4CacheSnapshot | None:
        """Reallocate for `capacity` tokens and migrate the live prefix (no reset).

        Returns `snapshot` (a turn anchor of this cache) rebound to the grown plan, or None.
        On any error this cache is left as it was.
        """
        grown = Deepseek4Cache(self.args, self.plan(capacity), self.context_length)
        rebound = grown.migrate_from(self, snapshot)
        self._plan, self.layers = grown._plan, grown.layers
        return rebound


def _with_prefix(dst: mx.array, src: mx.array, rows: int) -> mx.array:
    if rows == 0:
        return mx.array(dst)
    return mx.concatenate([src[:rows], dst[rows:]], axis=0)


def _validate_growth(source: Deepseek4CachePlan, target: Deepseek4CachePlan) -> None:
    if target.context_length <= source.context_length:
        raise MigrationContext(
            f"cache growth requires a larger context: source {source.context_length}, "
            f"target {target.context_length}"
        )
    if source.n_layers != target.n_layers:
        raise MigrationLayerCount(
            f"growth layer count {target.n_layers} does not match source {source.n_layers}"
        )
    if source.kv_dtype != target.kv_dtype or source.window != target.window:
        raise MigrationPlanMismatch("growth target has another row dtype or window")
    for s, t in zip(source.layers, target.layers, strict=True):
        if s.compress_ratio != t.compress_ratio or [b.kind for b in s.buffers] != [
            b.kind for b in t.buffers
        ]:
            raise MigrationPlanMismatch(f"layer {s.layer} buffers differ")
        for sb, tb in zip(s.buffers, t.buffers, strict=True):
            fixed = sb.kind in STATE_KINDS
            ok = (
                sb.shape == tb.shape
                if fixed
                else (sb.shape[1:] == tb.shape[1:] and sb.shape[0] <= tb.shape[0])
            )
            if not ok or sb.dtype != tb.dtype:
                raise MigrationPlanMismatch(f"layer {s.layer} {sb.kind} is not prefix-compatible")
