"""Defaults for MLX's CUDA graph knobs, chosen for chunked prefill.

MLX's CUDA backend records up to ``MLX_MAX_OPS_PER_BUFFER`` ops (default 20) into one CUDA
graph before launching it, and keeps ``MLX_CUDA_GRAPH_CACHE_SIZE`` (default 100) graphs
instantiated for reuse (``mlx/backend/cuda/eval.cpp`` and ``device.cpp``, v0.32). A
2,048-token Gemma 3 chunk is hundreds of ops, bound by the host's launching
(`bench.gpu_ablate`), and its graphs change with the position, so longer graphs and a
larger cache pay (docs/benchmarks.md, "Where a GPU chunk's time goes", has the H200
measurements).

MLX reads each knob once, at its first use, so `configure` must run before the first
evaluation on the GPU; ``model`` calls it on import. A value already in the environment is
kept. The knobs do nothing on the CPU or Metal.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

DEFAULTS = {"MLX_MAX_OPS_PER_BUFFER": "60", "MLX_CUDA_GRAPH_CACHE_SIZE": "2000"}


def configure(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set each of `DEFAULTS` in `environ` where it is unset; returns the values in effect."""
    for name, value in DEFAULTS.items():
        environ.setdefault(name, value)
    return {name: environ[name] for name in DEFAULTS}
