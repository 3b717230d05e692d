"""Defaults for MLX's CUDA graph and attention-cache knobs, chosen for chunked prefill.

MLX reads each knob once, at its first use, so `configure` must run before the first
evaluation on the GPU; ``model`` calls it on import. The knobs do nothing on the CPU or Metal.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# MLX's defaults are 20 ops a graph and 100 graphs (mlx/backend/cuda/eval.cpp, device.cpp,
# v0.32); a chunk's hundreds of host-bound ops, whose graphs change with the position, pay
# for longer graphs and a larger cache (docs/benchmarks.md, "Where a GPU chunk's time goes").
# MLX's CUDA attention (cuDNN, head dims up to 128: the Llama family, the tiny models) builds
# a graph per (query length, key length) shape, ~55 ms on an H200 (bench.lengths), and keeps
# them in an LRU of a few hundred (`MLX_CUDA_SDPA_CACHE_SIZE`, mlx/backend/cuda/
# scaled_dot_product_attention.cpp): served prompts of every length from 32 to 512 would
# evict each other, and recent MLX aborts the process after twice the capacity in misses.
DEFAULTS = {"MLX_MAX_OPS_PER_BUFFER": "60", "MLX_CUDA_GRAPH_CACHE_SIZE": "2000",
            "MLX_CUDA_SDPA_CACHE_SIZE": "8192"}


def configure(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set each of `DEFAULTS` in `environ` where it is unset; returns the values in effect."""
    for name, value in DEFAULTS.items():
        environ.setdefault(name, value)
    return {name: environ[name] for name in DEFAULTS}
