"""Loading a GGUF's tensors into an MLX module whose parameter names map onto GGUF names."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import mlx.core as mx
import mlx.nn as nn

from .reader import GGUFError, GGUFFile


def flat_block_name(param: str) -> str:
    """``blk.3.attn.attn_q.weight`` -> ``blk.3.attn_q.weight``: a GGUF block is flat, the
    module's block holds ``attn`` and ``mlp`` (mlx-lm's shape)."""
    return param.replace(".attn.", ".").replace(".mlp.", ".")


def load_gguf_weights(
    model: nn.Module, gguf: GGUFFile, gguf_name: Callable[[str], str], dtype: mx.Dtype
) -> nn.Module:
    """Fill every parameter of `model` from `gguf` and evaluate them.

    Args:
        gguf_name: parameter path -> GGUF tensor name (the architecture's one-line rule).
        dtype: float parameters become `dtype`; int32 parameters (token-id tables) stay int32.
    Raises:
        GGUFError: a tensor is missing, has another shape, or an unsupported type.
    """
    weights = []
    for name, param in nn.utils.tree_flatten(model.parameters()):
        array = gguf.tensor(gguf_name(name))
        if tuple(array.shape) != tuple(param.shape):
            raise GGUFError(
                f"{gguf.path.name}: tensor {gguf_name(name)!r} has shape {array.shape}, "
                f"expected {param.shape}"
            )
        target = mx.int32 if param.dtype == mx.int32 else dtype
        weights.append((name, mx.array(array).astype(target)))
    model.load_weights(weights, strict=True)
    mx.eval(model.parameters())
    return model


def unused_tensors(
    model: nn.Module, gguf: GGUFFile, gguf_name: Callable[[str], str], also: Iterable[str] = ()
) -> list[str]:
    """The tensors of `gguf` that no parameter of `model` (nor a name in `also`, a tensor the
    architecture reads itself) maps onto, sorted: a variant the module would silently
    ignore (a bias, a norm) if it loaded the rest."""
    used = {gguf_name(name) for name, _ in nn.utils.tree_flatten(model.parameters())}
    return sorted(set(gguf.tensor_types) - used - set(also))
