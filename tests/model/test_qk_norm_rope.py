"""`model.kernels.qk_norm_rope` on the CPU: its dispatch. The kernel itself runs on a CUDA GPU
only: `python -m bench.gpu --check --checks qk_norm` checks it there against MLX's compiled
`_heads_packed`, `tests/model/test_cuda_kernel_sources.py` that it compiles, and
`tests/model/test_gemma3_graph.py` the graph's use of that step."""

from __future__ import annotations

import mlx.core as mx
import pytest

from model.kernels import qk_norm_rope


def test_the_cpu_never_takes_the_kernel():
    qkv = mx.zeros((4, 6 * 256), dtype=mx.bfloat16)
    assert not qk_norm_rope.available() and not qk_norm_rope.enabled()
    with pytest.raises(ValueError, match="qk_norm_rope takes"):
        qk_norm_rope.qk_norm_rope(qkv, mx.arange(4), mx.ones((256,)), mx.ones((256,)),
                                  heads=4, kv_heads=1, base=10_000.0, scale=1.0, eps=1e-6)


def test_the_graph_takes_the_kernel_unless_told_not_to(monkeypatch):
    monkeypatch.setattr(qk_norm_rope.flash_attention, "available", lambda: True)
    monkeypatch.delenv(qk_norm_rope.ENV, raising=False)
    assert qk_norm_rope.available() and qk_norm_rope.enabled()
    monkeypatch.setenv(qk_norm_rope.ENV, "0")
    assert not qk_norm_rope.enabled()
