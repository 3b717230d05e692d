"""An optimized BLAS under MLX on a Linux CPU.

The ``mlx-cpu`` wheel bundles the netlib reference BLAS, which makes prefill ~45x slower
(docs/benchmarks.md, "Figures behind the code's choices"). Preloading a BLAS that exports
the CBLAS symbols overrides it; the loader only honours ``LD_PRELOAD`` at process start, so
the entry point re-executes itself once with it set. macOS (Accelerate, Metal) needs nothing.
"""

from __future__ import annotations

import glob
import logging
import os
import sys

log = logging.getLogger(__name__)

# OpenBLAS picks its kernels from CPUID at load time. Debian's 0.3.21 falls back to the slow
# generic "Prescott" kernels on some virtualized AVX-512 CPUs (docs/benchmarks.md), so name
# the core from /proc/cpuinfo flags, best first. An OPENBLAS_CORETYPE already set is kept.
CORETYPES = (
    ("Cooperlake", {"avx512f", "avx512vl", "avx512bw", "avx512dq", "avx512_bf16"}),
    ("SkylakeX", {"avx512f", "avx512vl", "avx512bw", "avx512dq"}),
    ("Haswell", {"avx2", "fma"}),
)

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


def openblas_coretype(cpuinfo: str | None = None) -> str | None:
    """The OpenBLAS core type matching this x86-64 CPU's flags, or None (other CPUs)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            break
    return next((name for name, needed in CORETYPES if needed <= flags), None)


def blas_env() -> dict[str, str]:
    """Environment to add so MLX runs on an optimized BLAS here ({} when none is needed)."""
    if not sys.platform.startswith("linux") or os.environ.get(DISABLE_FLAG) == "1":
        return {}
    env = {}
    preload = os.environ.get("LD_PRELOAD", "")
    if "blas" not in preload.lower():
        path = find_blas()
        if path is None:
            return {}
        env["LD_PRELOAD"] = f"{path}:{preload}" if preload else path
    if "OPENBLAS_CORETYPE" not in os.environ:
        coretype = openblas_coretype()
        if coretype is not None:
            env["OPENBLAS_CORETYPE"] = coretype
    return env


def blas_summary() -> str:
    """One line naming the BLAS MLX runs on in this process (for logs)."""
    if not sys.platform.startswith("linux"):
        return "platform BLAS (Accelerate)"
    preload = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if "blas" in p.lower()]
    if preload:
        core = os.environ.get("OPENBLAS_CORETYPE", "detected by OpenBLAS")
        return f"{preload[0]} (preloaded; OpenBLAS core {core})"
    return "MLX's bundled reference BLAS (~45x slower; see README)"


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

    On Linux, when `blas_env` has something to add, re-executes the current command with
    it (never returns then). Returns a one-line description of the BLAS setup.
    """
    if not sys.platform.startswith("linux"):
        return "platform BLAS (Accelerate)"
    if os.environ.get(DISABLE_FLAG) == "1":
        return "MLX's bundled reference BLAS (preload disabled)"
    env = blas_env()
    if not env or os.environ.get(REEXEC_FLAG) == "1":
        if "blas" in os.environ.get("LD_PRELOAD", "").lower():
            core = os.environ.get("OPENBLAS_CORETYPE", "detected by OpenBLAS")
            return f"preloaded {os.environ['LD_PRELOAD']} (core: {core})"
        return (
            "MLX's bundled reference BLAS: ~45x slower on CPU; install an optimized one "
            "(Debian/Ubuntu: apt-get install libopenblas0-pthread)"
        )
    env = {**os.environ, **env, REEXEC_FLAG: "1"}
    # orig_argv keeps the interpreter's own options (``-m worker``), unlike argv
    argv = [sys.executable, *sys.orig_argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)
    raise AssertionError("unreachable")  # pragma: no cover


def main() -> int:
    """``python -m model.runtime.blas``: print `blas_env` as shell assignments (Makefile)."""
    print(" ".join(f"{k}={v}" for k, v in blas_env().items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
