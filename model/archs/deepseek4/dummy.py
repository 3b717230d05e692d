"""DeepSeek-V4 with random weights of real shapes (``--load-format dummy``), for benchmarks."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn

from .model import Model, ModelArgs


def dummy_model(
    args: ModelArgs,
    n_layers: int | None = None,
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
    **overrides,
) -> Model:
    """Random weights with real shapes (``--load-format dummy``), for benchmarks.

    Args:
        n_layers: keep the first `n_layers` layers of the schedule (default all).
        overrides: other `ModelArgs` fields (e.g. ``n_routed_experts=16`` to fit memory).
    """
    if n_layers is not None:
        overrides |= dict(
            num_hidden_layers=n_layers, compress_ratios=tuple(args.compress_ratios[:n_layers])
        )
    args = replace(args, **overrides)
    mx.random.seed(seed)
    model = Model(args)
    weights = []
    for name, param in nn.utils.tree_flatten(model.parameters()):
        if param.dtype == mx.int32:
            value = mx.random.randint(0, args.n_routed_experts, param.shape, dtype=mx.int32)
        elif name.endswith(("norm.weight", "scale.weight")):
            value = mx.ones(param.shape)
        elif name.endswith(("base.weight", "ape.weight", "sinks.weight", ".bias")):
            value = mx.zeros(param.shape)
        else:
            value = mx.random.normal(param.shape) * param.shape[-1] ** -0.5
        weights.append((name, value.astype(mx.int32 if param.dtype == mx.int32 else dtype)))
    model.load_weights(weights, strict=True)
    mx.eval(model.parameters())
    return model
