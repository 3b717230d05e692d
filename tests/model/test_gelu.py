"""`model.kernels.gelu` on the CPU: the reference gated product and the fused kernel's
dispatch (the kernel itself runs on a CUDA GPU only; `python -m bench.gpu --check
--checks gelu` checks it there against float32 and MLX's compiled product)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from model.kernels import gelu


def test_the_gate_is_gelu_tanh_times_up():
    x = np.linspace(-4, 4, 33, dtype=np.float32)
    up = np.linspace(0.5, 2, 33, dtype=np.float32)
    want = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))) * up
    got = np.array(gelu.gelu_gate(mx.array(x), mx.array(up)))
    assert float(np.abs(got - want).max()) <= 1e-6 * float(np.abs(want).max())


def test_the_cpu_never_takes_the_fused_kernel():
    gate_up = mx.zeros((1, 4, 64), dtype=mx.bfloat16)
    assert not gelu.supports(gate_up)
    with pytest.raises(ValueError, match="fused_gelu_gate takes"):
        gelu.fused_gelu_gate(gate_up)
