"""Compile CUDA C++ to a cubin with NVRTC, for kernels MLX's own JIT cannot build.

`mx.fast.cuda_kernel` compiles for the device's plain architecture (``sm_90`` on Hopper),
where the warpgroup MMA instructions (`wgmma`, PTX ISA 8.0) are refused: they need the
architecture-specific target ``sm_90a``. This module calls the NVRTC library that MLX's CUDA
backend already loads (through ctypes: no new dependency) and returns the machine code, which
`mx.fast.precompiled_cuda_kernel` launches.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from functools import cache
from pathlib import Path

# NVRTC's sonames, newest first (MLX's CUDA 13 wheel links .13; CUDA 12 builds .12)
SONAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")


class NvrtcError(RuntimeError):
    """NVRTC could not be loaded, or refused the source (the message carries its log)."""


def _candidates() -> list[str]:
    found = list(SONAMES)
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            found += [str(p) for p in sorted(Path(root, "lib64").glob("libnvrtc.so*"))]
    try:  # the nvidia-cuda-nvrtc wheel, where pip put it
        import nvidia  # type: ignore[import-not-found]

        for base in getattr(nvidia, "__path__", []):
            found += [str(p) for p in sorted(Path(base).glob("*/lib/libnvrtc.so*"))]
    except ImportError:
        pass
    if (name := ctypes.util.find_library("nvrtc")):
        found.append(name)
    return found


@cache
def library() -> ctypes.CDLL:
    """The NVRTC shared library (the first of `SONAMES`, ``$CUDA_HOME/lib64``, the
    nvidia-cuda-nvrtc wheel, the linker's search path that loads).

    Raises:
        NvrtcError: none of them loads.
    """
    errors = []
    for name in _candidates():
        try:
            # NVRTC opens its builtins library by soname: one beside it (a wheel's folder,
            # off the linker's path) is loaded first so that the lookup finds it
            for builtins in sorted(Path(name).parent.glob("libnvrtc-builtins.so*")):
                if "/" in name and ".alt." not in builtins.name:
                    ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
            lib = ctypes.CDLL(name)
        except OSError as e:
            errors.append(f"{name}: {e}")
            continue
        if "builtins" in name or not hasattr(lib, "nvrtcCompileProgram"):
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        return lib
    raise NvrtcError("NVRTC is not installed: " + "; ".join(errors[-3:]))


def _check(lib: ctypes.CDLL, status: int, call: str) -> None:
    if status != 0:
        raise NvrtcError(f"{call}: {lib.nvrtcGetErrorString(status).decode()}")


def compile_cubin(source: str, name: str, arch: str, options: tuple[str, ...] = ()) -> bytes:
    """Machine code of `source` for `arch`.

    Args:
        source: CUDA C++ (kernels ``extern "C"``, so their names are not mangled).
        name: the program's file name in NVRTC's messages.
        arch: an NVRTC architecture with SASS, e.g. ``"sm_90a"``.
        options: more NVRTC options (``-D...``, ``--use_fast_math``).
    Returns:
        The cubin's bytes.
    Raises:
        NvrtcError: NVRTC is missing, or the source does not compile (with NVRTC's log).
    """
    lib = library()
    program = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(),
                                       0, None, None), "nvrtcCreateProgram")
    try:
        args = [f"--gpu-architecture={arch}", "--std=c++17", *options]
        argv = (ctypes.c_char_p * len(args))(*[a.encode() for a in args])
        status = lib.nvrtcCompileProgram(program, len(args), argv)
        if status != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(program, log)
            raise NvrtcError(f"{name} does not compile for {arch}:\n"
                             f"{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))
