"""Models, KV caches and chunked prefill in MLX (no Redis: `jobs` and `worker` use this).

Importing it sets MLX's CUDA graph knobs to prefillq's defaults where the environment leaves
them unset (`model.runtime.cuda_graphs`), before anything runs on a GPU.
"""

from .runtime import cuda_graphs as _cuda_graphs

_cuda_graphs.configure()
