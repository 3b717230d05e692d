"""Fused GPU kernels for MLX, used where MLX's own ops fall short; the unfused MLX path stays
the reference (CPU, Metal, and every test) and the fallback."""

import hashlib
from pathlib import Path

# mma.sync, ldmatrix, cp.async and the online softmax: every kernel's header
HEADER = Path(__file__).with_name("mma.cuh").read_text()
# the attention kernels' variants: one chunk (its keys split or not), several jobs' chunks
# packed
ONE, SPLIT, PACKED = "one", "split", "packed"


def source_tag(*texts: str) -> str:
    """Eight hex digits of the SHA-1 of a kernel's source `texts`, for its name: MLX caches
    compiled kernels on disk by name (``$MLX_PTX_CACHE_DIR``, else a temp folder per MLX
    version), so a kernel whose source changed must not keep an old name."""
    return hashlib.sha1("".join(texts).encode()).hexdigest()[:8]
