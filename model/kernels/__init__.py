"""Fused GPU kernels for MLX, used where MLX's own ops fall short; the unfused MLX path stays
the reference (CPU, Metal, and every test) and the fallback."""

import hashlib


def source_tag(*texts: str) -> str:
    """Eight hex digits of the SHA-1 of a kernel's source `texts`, for its name: MLX caches
    compiled kernels on disk by name (``$MLX_PTX_CACHE_DIR``, else a temp folder per MLX
    version), so a kernel whose source changed must not keep an old name."""
    return hashlib.sha1("".join(texts).encode()).hexdigest()[:8]
