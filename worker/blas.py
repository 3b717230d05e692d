"""An optimized BLAS under MLX on a Linux CPU.

The ``mlx-cpu`` wheel bundles the netlib reference BLAS: float32 GEMM at ~3 GFLOP/s where
OpenBLAS reaches 80-140 on the same 2 cores, so prefill is ~45x slower (shared/CPU.md).
Preloading a BLAS that exports the CBLAS symbols overrides it; the loader only honours
``LD_PRELOAD`` at process start, so the entry point re-executes itself once with it set.
macOS (Accelerate, Metal) needs nothing.
"""

from __future__ import annotations

import glob
import logging
import os
import sys

log = logging.getLogger(__name__)

# Set by the re-exec so a failed preload cannot loop.
REEXEC_FLAG = "PREFILLQ_BLAS_REEXEC"
# Set to 1 to skip the preload (e.g. on a CUDA machine, or to measure the reference BLAS).
DISABLE_FLAG = "PREFILLQ_NO_BLAS_PRELOAD"
# Debian/Ubuntu `libopenblas0-pthread` (what the Makefile, Dockerfile and CI install), then
# other common locations.
CANDIDATES = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/*-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas*.so*",
    "/usr/local/lib/libopenblas*.so*",
)


def find_blas() -> str | None:
    """Path of an optimized BLAS shared library on this machine, or None."""
    for pattern in CANDIDATES:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def loaded_blas() -> list[str]:
    """BLAS libraries mapped into this process (Linux ``/proc/self/maps``)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "blas" in line.lower()}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/"))


def ensure_blas() -> str:
    """Make sure MLX will use an optimized BLAS; call before importing MLX.

    On Linux without one preloaded, re-executes the current command with ``LD_PRELOAD``
    (never returns then). Returns a one-line description of the BLAS in use.
    """
    if not sys.platform.startswith("linux"):
        return "platform BLAS (Accelerate)"
    preload = os.environ.get("LD_PRELOAD", "")
    if "blas" in preload.lower():
        return f"preloaded {preload}"
    if os.environ.get(DISABLE_FLAG) == "1":
        return "MLX's bundled reference BLAS (preload disabled)"
    path = find_blas()
    if path is None or os.environ.get(REEXEC_FLAG) == "1":
        return (
            "MLX's bundled reference BLAS: ~45x slower on CPU; install an optimized one "
            "(Debian/Ubuntu: apt-get install libopenblas0-pthread)"
        )
    env = dict(os.environ, LD_PRELOAD=f"{path}:{preload}" if preload else path)
    env[REEXEC_FLAG] = "1"
    # orig_argv keeps the interpreter's own options (``-m worker``), unlike argv
    argv = [sys.executable, *sys.orig_argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)
    raise AssertionError("unreachable")  # pragma: no cover
