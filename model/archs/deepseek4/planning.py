"""DeepSeek-V4 cache plan: every buffer's shape and bytes for a context (pure arithmetic).

Sources: the DeepSeek-V4 reference ``inference/model.py`` (``Attention``, ``Compressor``) and
hf2q's ``Deepseek4Cache`` (github.com/robertelee78/hf2q ``src/inference/models/deepseek4``).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import mlx.core as mx

from ... import cache as base
from ...cache_plan import SERVING_CAPACITY_STEP_TOKENS
from ...cache_state import dtype_bytes

ARCHITECTURE = "deepseek4"  # general.architecture of its GGUFs
SUPPORTED_RATIOS = (0, 4, 128)
OVERLAP_RATIO = 4  # only ratio-4 compressors overlap (and only ratio-4 layers index)
# A serving cache grows in steps of this many tokens (hf2q's INITIAL_CACHE_LENGTH).
INITIAL_CACHE_LENGTH = SERVING_CAPACITY_STEP_TOKENS
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
    """One layer's buffers, for compress ratio ``r``:

    - ``window``: ring of the last ``min(context, W)`` KV rows ``(rows, head_dim)``;
    - ``compressed`` (r > 0): ``(context // r, head_dim)``, row ``j`` pools tokens
      ``[j*r, (j+1)*r)``;
    - ``indexer`` (r == 4): ``(context // 4, index_head_dim)`` lightning-indexer keys;
    - ``main_kv_state``/``main_score_state`` (and ``indexer_*`` for r == 4): float32
      ``(coff*r, coff*d)`` compressor state, ``coff = 2`` iff r == 4.
    """

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

    def describe_layers(self) -> list[str]:
        """One line per layer, e.g. ``layer  3 (ratio 128): window [128, 512], compressed
        [8, 512], ...`` (buffer kinds and shapes)."""
        return [
            f"layer {layer.layer:>2} (ratio {layer.compress_ratio}): "
            + ", ".join(f"{b.kind} {list(b.shape)}" for b in layer.buffers)
            for layer in self.layers
        ]

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
    item = dtype_bytes(dtype)
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
        fixed += W * hd * dtype_bytes(kv_dtype)
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


def plan_dtype(name: str) -> mx.Dtype:
    """A plan's ``kv_dtype`` (``"mlx.core.bfloat16"``) -> ``mx.bfloat16``."""
    return {str(d): d for d in (mx.float32, mx.float16, mx.bfloat16)}[name]
