"""MLX's ``mx.fast.cuda_kernel`` emulated on a machine without a GPU, so that a kernel body's
CUDA compiles in CI: the body is wrapped as MLX's CUDA backend wraps it
(``mlx/backend/cuda/custom_kernel.cpp``, ``build_kernel``: each input a ``const T*``
parameter followed by its ``<name>_shape``, ``<name>_strides`` and ``<name>_ndim`` where the
source names them, then the outputs, then the template arguments as ``constexpr``
constants, all inside ``namespace mlx::core::cu``) and compiled by NVRTC against the CUDA
headers of the test extra's wheels (``nvidia-cuda-runtime``, ``nvidia-cuda-crt``). The
launch returns zeros: it checks that the source compiles with the arguments its caller
passes, not what it computes (``bench.gpu --check`` does that on a GPU).
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest

from model.kernels.nvrtc import compile_cubin
from tests.model.sass import nvrtc_or_skip

ARCH = "sm_90"  # the H100 and H200 the kernels are tuned for
CUDA_TYPES = {mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.float32: "float",
              mx.int32: "int32_t", mx.uint32: "uint32_t", mx.int64: "int64_t",
              mx.uint8: "uint8_t", mx.bool_: "bool"}
# What MLX's default header (``mlx/backend/cuda/device/utils.cuh``, cooperative groups and
# ``inf``) gives a kernel body, as far as these kernels use it: the fixed-width integers,
# bf16 and fp16, and ``Shape`` and ``Strides`` (MLX: ``cuda::std::array`` of MAX_NDIM
# int32 and int64) indexed by dimension. Not cooperative groups (``cg``), which need CCCL's
# headers: a body that uses them does not compile here.
PRELUDE = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#define inf __int_as_float(0x7f800000)
namespace mlx::core::cu {
constexpr int MAX_NDIM = 10;
struct Shape { int32_t d[MAX_NDIM]; __device__ int32_t operator[](int i) const { return d[i]; } };
struct Strides { int64_t d[MAX_NDIM]; __device__ int64_t operator[](int i) const { return d[i]; } };
}
"""


def include_dir() -> Path:
    """The CUDA headers' folder of the ``nvidia-cuda-runtime`` wheel (skips the test
    without it)."""
    found = sorted(Path(sys.prefix).glob("lib/python3*/site-packages/nvidia/cu*/include"))
    found = [p for p in found if (p / "cuda_bf16.h").exists()]
    if not found:
        pytest.skip("the CUDA headers are not installed (the test extra's nvidia-cuda-runtime)")
    return found[0]


def wrapped(name: str, input_names: list[str], inputs: list[mx.array], output_names: list[str],
            output_dtypes: list[mx.Dtype], template: list[tuple[str, object]], source: str,
            header: str) -> str:
    """The translation unit MLX's ``build_kernel`` makes of a kernel body."""
    params = []
    for arg, x in zip(input_names, inputs, strict=True):
        params.append(f"const {CUDA_TYPES[x.dtype]}* {arg}")
        if x.ndim > 0:
            params += [f"const __grid_constant__ {kind} {arg}_{suffix}"
                       for kind, suffix in (("Shape", "shape"), ("Strides", "strides"),
                                            ("int", "ndim")) if f"{arg}_{suffix}" in source]
    params += [f"{CUDA_TYPES[d]}* {arg}" for arg, d in zip(output_names, output_dtypes,
                                                           strict=True)]
    constants = []
    for arg, value in template:
        if isinstance(value, bool):
            constants.append(f"  constexpr bool {arg} = {str(value).lower()};")
        elif isinstance(value, int):
            constants.append(f"  constexpr int {arg} = {value};")
        else:
            constants.append(f"  using {arg} = {CUDA_TYPES[value]};")
    return (PRELUDE + header + "namespace mlx::core::cu {\n"
            f"__global__ void {name}(\n    " + ",\n    ".join(params) + ") {\n"
            + "\n".join(constants) + "\n" + source + "\n}\n}\n")


class EmulatedKernels:
    """A stand-in for ``mx.fast.cuda_kernel`` whose launches compile (``compiled``: each
    launch's kernel name and template) and return zeros."""

    def __init__(self):
        nvrtc_or_skip()
        self.include = include_dir()
        self.compiled: list[tuple[str, tuple]] = []

    def cuda_kernel(self, name: str, input_names, output_names, source: str, header: str = "",
                    ensure_row_contiguous: bool = True, atomic_outputs: bool = False,
                    shared_memory: int = 0):
        def launch(*, inputs, output_shapes, output_dtypes, grid, threadgroup, template=(),
                   init_value=None, verbose=False, stream=None):
            unit = wrapped(name, list(input_names), list(inputs), list(output_names),
                           list(output_dtypes), list(template), source, header)
            compile_cubin(unit, name + ".cu", ARCH, (f"-I{self.include}", "-std=c++17"))
            self.compiled.append((name, tuple(template)))
            return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes,
                                                                     output_dtypes,
                                                                     strict=True)]
        return launch
