"""KV cache plans: per-layer shapes and the byte arithmetic of a cache (pure, no buffers).

`plan_cache` sizes the standard caches (`model.kv_cache`); DeepSeek-V4's own plan is
`model.archs.deepseek4.planning`. `cache_capacity_for_request` is the growth rule every
cache follows.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .cache_state import dtype_bytes

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
