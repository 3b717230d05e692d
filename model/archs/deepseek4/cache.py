"""DeepSeek-V4 KV cache: circular window, compressed rows, indexer rows, compressor state.

Ported from hf2q's ``Deepseek4Cache`` (seeds 004). Per layer with compress ratio ``r``:

- ``window``: ring of the last ``min(context, W)`` KV rows ``(rows, head_dim)``, row of
  position ``p`` at slot ``p % rows`` (overwritten: snapshots copy it);
- ``compressed`` (r > 0): ``(context // r, head_dim)``, row ``j`` pools tokens
  ``[j*r, (j+1)*r)`` (append-only: a restored position hides later rows);
- ``indexer`` (r == 4): ``(context // 4, index_head_dim)`` lightning-indexer keys;
- ``main_kv_state``/``main_score_state`` (and ``indexer_*`` for r == 4): float32
  ``(coff*r, coff*d)`` recurrent compressor state, ``coff = 2`` iff r == 4. Slots ``[0, r)``
  of an overlapping compressor hold the previous complete window, the remainder tokens of
  the current window sit at slot ``off + t % r`` (``off = r`` if overlapping else 0), as in
  the DeepSeek-V4 reference ``Compressor`` decode state.

The committed ``position`` is the prefill cursor; a forward pass writes past it and
``commit`` advances it only after the chunk was evaluated.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import mlx.core as mx

from ... import cache as base

SUPPORTED_RATIOS = (0, 4, 128)
OVERLAP_RATIO = 4  # only ratio-4 compressors overlap (and only ratio-4 layers index)
# hf2q grows a serving cache in steps of this many tokens (seeds 000 INITIAL_CACHE_LENGTH).
INITIAL_CACHE_LENGTH = 131_072
STATE_DTYPE = mx.float32
STATE_KINDS = ("main_kv_state", "main_score_state", "indexer_kv_state", "indexer_score_state")


class Deepseek4CacheError(base.CacheError):
    """Base class of DeepSeek-V4 cache errors."""


class EmptyContext(Deepseek4CacheError, ValueError):
    """A cache for zero tokens was requested."""


class ContextBound(Deepseek4CacheError, ValueError):
    """The requested context exceeds the model's context length."""


class SlidingWindow(Deepseek4CacheError, ValueError):
    """The window is not positive, or a plan's window differs from the model's."""


class LayerCount(Deepseek4CacheError, ValueError):
    """The compression schedule has a different length than the model's layer count."""


class CompressionRatio(Deepseek4CacheError, ValueError):
    """A layer's compress ratio is not 0, 4 or 128."""


class Accounting(Deepseek4CacheError):
    """Allocated bytes differ from the plan's."""


class ContextExhausted(base.ContextExhausted, Deepseek4CacheError):
    """A chunk would write past the cache's serving context."""


class Poisoned(base.CachePoisoned, Deepseek4CacheError):
    """A chunk failed part-way; ``reset()`` the cache and replay."""


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


@dataclass(frozen=True)
class BufferPlan:
    """One buffer. ``per_token_bytes`` is its context-linear share (0 for fixed buffers)."""

    kind: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    per_token_bytes: Fraction = Fraction(0)


@dataclass(frozen=True)
class LayerCachePlan:
    layer: int
    compress_ratio: int
    buffers: tuple[BufferPlan, ...]

    @property
    def resident_bytes(self) -> int:
        return sum(b.bytes for b in self.buffers)

    def buffer(self, kind: str) -> BufferPlan | None:
        return next((b for b in self.buffers if b.kind == kind), None)


@dataclass(frozen=True)
class Deepseek4CachePlan:
    """Byte accounting of a DeepSeek-V4 cache for `context_length` tokens (pure arithmetic).

    Attributes:
        window: the model's sliding window in tokens.
        bytes_per_token: context-linear bytes per token (compressed and indexer rows).
        fixed_bytes: bytes independent of context (full window rings, compressor state).
        resident_bytes: all buffers at `context_length`; equals ``fixed_bytes +
            bytes_per_token * context_length`` when the context is a multiple of every
            ratio and at least one window.
    """

    context_length: int
    kv_dtype: str
    window: int
    layers: tuple[LayerCachePlan, ...]
    bytes_per_token: int | float
    fixed_bytes: int

    @property
    def resident_bytes(self) -> int:
        return sum(layer.resident_bytes for layer in self.layers)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def summary(self) -> dict[str, Any]:
        """The JSON-able totals (what ``prefillq plan --json`` prints)."""
        return {
            "n_layers": self.n_layers,
            "context_length": self.context_length,
            "kv_dtype": self.kv_dtype,
            "window": self.window,
            "bytes_per_token": self.bytes_per_token,
            "fixed_bytes": self.fixed_bytes,
            "resident_bytes": self.resident_bytes,
        }


def _buffer(kind: str, shape: tuple[int, ...], dtype: mx.Dtype, ratio: int = 0) -> BufferPlan:
    item = base.dtype_bytes(dtype)
    row_bytes = item * shape[1]
    per_token = Fraction(row_bytes, ratio) if ratio else Fraction(0)
    return BufferPlan(kind, shape, str(dtype), item * shape[0] * shape[1], per_token)


def _state_buffers(prefix: str, ratio: int, dim: int) -> list[BufferPlan]:
    coff = 2 if ratio == OVERLAP_RATIO else 1
    shape = (coff * ratio, coff * dim)
    return [
        _buffer(f"{prefix}_kv_state", shape, STATE_DTYPE),
        _buffer(f"{prefix}_score_state", shape, STATE_DTYPE),
    ]


def validate_schedule(args: Any) -> None:
    """Check window and compress ratios of `args` (a `deepseek4.ModelArgs`)."""
    if args.sliding_window < 1:
        raise SlidingWindow(f"sliding window must be positive, got {args.sliding_window}")
    ratios = list(args.compress_ratios)
    if len(ratios) != args.num_hidden_layers:
        raise LayerCount(
            f"compression schedule has {len(ratios)} layers, expected {args.num_hidden_layers}"
        )
    for layer, ratio in enumerate(ratios):
        if ratio not in SUPPORTED_RATIOS:
            raise CompressionRatio(f"layer {layer} has unsupported compression ratio {ratio}")


def plan(args: Any, context_length: int, kv_dtype: mx.Dtype = mx.bfloat16) -> Deepseek4CachePlan:
    """Plan every buffer of a cache for `context_length` tokens with `kv_dtype` KV rows.

    Args:
        args: a `deepseek4.ModelArgs` (compress_ratios, sliding_window, head_dim,
            index_head_dim, num_hidden_layers, context_length).
        kv_dtype: window/compressed/indexer row dtype (compressor state is always float32).
    Raises:
        EmptyContext, ContextBound, SlidingWindow, LayerCount, CompressionRatio.
    """
    if context_length <= 0:
        raise EmptyContext("DeepSeek-V4 cache context must be greater than zero")
    if context_length > args.context_length:
        raise ContextBound(
            f"requested cache context {context_length} exceeds model bound {args.context_length}"
        )
    validate_schedule(args)
    hd, ihd, W = args.head_dim, args.index_head_dim, args.sliding_window
    layers, per_token, fixed = [], Fraction(0), 0
    for layer, r in enumerate(args.compress_ratios):
        buffers = [_buffer("window", (min(context_length, W), hd), kv_dtype)]
        fixed += W * hd * base.dtype_bytes(kv_dtype)
        if r:
            buffers.append(_buffer("compressed", (context_length // r, hd), kv_dtype, r))
            states = _state_buffers("main", r, hd)
            if r == OVERLAP_RATIO:
                buffers.append(_buffer("indexer", (context_length // r, ihd), kv_dtype, r))
                states += _state_buffers("indexer", r, ihd)
            buffers += states
            fixed += sum(s.bytes for s in states)
        per_token += sum(b.per_token_bytes for b in buffers)
        layers.append(LayerCachePlan(layer, r, tuple(buffers)))
    bpt = int(per_token) if per_token.denominator == 1 else float(per_token)
    return Deepseek4CachePlan(context_length, str(kv_dtype), W, tuple(layers), bpt, fixed)


def cache_capacity_for_request(
    serving_context: int, current_capacity: int, prompt_tokens: int, max_tokens: int
) -> int:
    """Capacity to hold a request: the current one if it fits, else the next multiple of
    ``INITIAL_CACHE_LENGTH`` tokens, capped at `serving_context` (seeds 000)."""
    required = min(prompt_tokens + max(max_tokens, 1) - 1, serving_context)
    if required <= current_capacity:
        return current_capacity
    steps = -(-required // INITIAL_CACHE_LENGTH)
    return min(steps * INITIAL_CACHE_LENGTH, serving_context)


def _dtype(name: str) -> mx.Dtype:
    return {str(d): d for d in (mx.float32, mx.float16, mx.bfloat16)}[name]


class LayerCache:
    """One layer's buffers (attributes named after the plan's buffer kinds, None if absent)."""

    def __init__(self, layer_plan: LayerCachePlan):
        self.plan = layer_plan
        self.ratio = layer_plan.compress_ratio
        self.window = self.compressed = self.indexer = None
        self.main_kv_state = self.main_score_state = None
        self.indexer_kv_state = self.indexer_score_state = None
        for b in layer_plan.buffers:
            setattr(self, b.kind, mx.zeros(b.shape, _dtype(b.dtype)))
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

    # -- circular window ------------------------------------------------------------------
    def window_rows(self, start: int, stop: int) -> mx.array:
        """Rows of positions ``[start, stop)`` (at most the ring's size), oldest first."""
        n = self.window.shape[0]
        assert 0 <= stop - start <= n, f"{stop - start} rows from a ring of {n}"
        if stop == start:
            return self.window[:0]
        a, b = start % n, stop % n
        if a < b:
            return self.window[a:b]
        return mx.concatenate([self.window[a:], self.window[:b]], axis=0)

    def write_window(self, rows: mx.array, start: int) -> None:
        """Keep the newest ring-size rows of `rows` (positions ``[start, start + len)``)."""
        n, L = self.window.shape[0], rows.shape[0]
        keep = min(L, n)
        rows, start = rows[L - keep :].astype(self.window.dtype), start + L - keep
        a = start % n
        first = min(keep, n - a)
        self.window[a : a + first] = rows[:first]
        if first < keep:
            self.window[: keep - first] = rows[first:]


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
    """One job's DeepSeek-V4 cache (the `model.cache.ModelCache` interface).

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

    @classmethod
    def for_model(
        cls, args: Any, kv_dtype: mx.Dtype, capacity: int = 0, context_length: int = 0
    ) -> Deepseek4Cache:
        """A cache reserving `capacity` tokens now (grown in steps up to `context_length`)."""
        ctx = context_length or args.context_length
        initial = min(ctx, INITIAL_CACHE_LENGTH)
        cap = cache_capacity_for_request(ctx, initial, max(capacity, 1), 1)
        return cls(args, plan(args, cap, kv_dtype), ctx)

    @property
    def capacity(self) -> int:
        return self._plan.context_length

    def plan(self, context_length: int | None = None) -> Deepseek4CachePlan:
        if context_length is None:
            return self._plan
        return plan(self.args, context_length, _dtype(self._plan.kv_dtype))

    def state(self) -> list[mx.array]:
        """Every buffer, for ``mx.eval`` after a chunk."""
        return [a for layer in self.layers for a in layer.arrays()]

    def check_chunk(self, n_tokens: int) -> None:
        """Raise before a forward pass that must not run; grow the capacity if it must.

        Raises:
            Poisoned: a chunk failed earlier. ContextExhausted: past the serving context.
        """
        if self._poisoned:
            raise Poisoned("DeepSeek-V4 cache is poisoned by a partial chunk; reset and replay")
        end = self.position + n_tokens
        if end > self.context_length:
            raise ContextExhausted(
                f"chunk of {n_tokens} tokens at position {self.position} exceeds the "
                f"context length {self.context_length}"
            )
        if end > self.capacity:
            self.grow(cache_capacity_for_request(self.context_length, self.capacity, end, 1))

    def commit(self, n_tokens: int) -> None:
        """Advance the position after a chunk of `n_tokens` completed and was evaluated."""
        if self.position + n_tokens > self.capacity:
            raise ContextExhausted(f"DeepSeek-V4 cache is full at {self.capacity} tokens")
        super().commit(n_tokens)

    def snapshot(self) -> Deepseek4CacheSnapshot:
        """Rollback point at the current position (copies rings and compressor state)."""
        if self._poisoned:
            raise Poisoned("cannot snapshot a poisoned DeepSeek-V4 cache")
        layers = tuple(
            {k: mx.array(getattr(layer, k)) for k in _COPIED_KINDS if getattr(layer, k) is not None}
            for layer in self.layers
        )
        mx.eval([a for layer in layers for a in layer.values()])
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
        self._poisoned = False

    def migrate_from(
        self, source: Deepseek4Cache, snapshot: Deepseek4CacheSnapshot | None = None
    ) -> Deepseek4CacheSnapshot | None:
        """Copy `source`'s live prefix into this larger cache; `source` is never modified.

        Nothing in this cache changes unless every check passes. Returns `snapshot` rebound to
        this cache's plan (so a turn anchor survives growth), or None.

        Raises:
            Poisoned, MigrationContext, MigrationLayerCount, MigrationPlanMismatch,
            MigrationSnapshotPlanMismatch, MigrationSnapshotPosition.
        """
        if source.is_poisoned:
            raise Poisoned("cannot migrate from a poisoned DeepSeek-V4 cache")
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
