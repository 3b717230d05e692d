"""Defaults for MLX's CUDA graph knobs, chosen for chunked prefill.

MLX's CUDA backend records up to ``MLX_MAX_OPS_PER_BUFFER`` ops (default 20) into one CUDA
graph before launching it, and keeps ``MLX_CUDA_GRAPH_CACHE_SIZE`` (default 100) graphs
instantiated for reuse (``mlx/backend/cuda/eval.cpp`` and ``device.cpp``, v0.32). A
2,048-token Gemma 3 chunk is hundreds of ops, bound by the host's launching
(`bench.gpu_ablate`), and its graphs change with the position, so longer graphs and a
larger cache pay. On the H200 (``python -m bench.gpu``, Gemma 3 270M shapes, 2,048-token
chunks; `bench/results/`):
- fea2f09, one lease: 284K tok/s at 8K and 200K at 32K with 60 and 2,000, against 239K and
  185K with MLX's defaults (``gpu-h200-2026-12-01-knobs.jsonl``; 241K and 178K in the run
  before it, ``gpu-h200-2026-12-01-fea2f09.jsonl``);
- 4cc7d76, with two chunks in flight (`model.prefill.Prefill.run`): 258K against 191K at
  32K, and no gain at 8K (279K against 286K: noise at ~30 ms a prefill)
  (``gpu-h200-2026-12-01-final.jsonl``, ``-final-mlx-graph-defaults.jsonl``).

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
