"""Gemma 3's RoPE scaling and query scale as llama.cpp's Gemma 3 loader reads them: linear
scaling (``gemma3.rope.scaling.factor``, 8 in the 4B, 12B and 27B GGUFs) in the global layers
only, the sliding ones at 1 (``rope_freq_scale_train_swa``), and 27B's queries scaled by
1/sqrt(hidden / heads); the module forward and the compiled graphs apply both."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from model.archs import _gemma3_graph, gemma3
from model.archs._gemma3_graph import GraphForward
from model.gguf.reader import GGUFError, read_gguf
from model.gguf.synthetic.gemma3 import write_tiny_gemma3
from tests.model.gguf_edits import with_metadata
from tests.model.graph_harness import (
    assert_scores_as_alone,
    logits_alone,
    mlx_attend,
    mlx_attend_packed,
    mlx_heads,
)

FACTOR = 8.0


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    """A tiny Gemma 3 GGUF (6 layers, the last global) with 256-wide heads, as the ``heads``
    step takes, and linear RoPE scaling by `FACTOR`."""
    path = tmp_path_factory.mktemp("g") / "scaled.gguf"
    return read_gguf(write_tiny_gemma3(path, head_dim=256, rope_scaling_factor=FACTOR))


def test_the_global_layers_alone_scale_their_positions(scaled):
    model = gemma3.load(scaled)
    assert model.args.rope_scale == 1 / FACTOR
    assert [b.attn.rope_scale for b in model.blk] == [1.0] * 5 + [1 / FACTOR]
    assert [b.attn.rope_base for b in model.blk] == [10_000.0] * 5 + [1_000_000.0]
    assert gemma3.ModelArgs.from_gguf(with_metadata(scaled, rope__scaling__type="none")
                                      ).rope_scale == 1.0
    with pytest.raises(GGUFError, match="rope scaling type 'yarn' is not supported"):
        gemma3.ModelArgs.from_gguf(with_metadata(scaled, rope__scaling__type="yarn"))


def test_27b_scales_its_queries_by_hidden_over_heads(scaled):
    """llama.cpp: 1/sqrt(5,376 / 32) = 1/sqrt(168) for the 62-layer 27B, 1/sqrt(head_dim)
    for every other size (4B's 34 layers here)."""
    shape = {"embedding_length": 5376, "attention__head_count": 32,
             "attention__head_count_kv": 16, "attention__key_length": 128}
    big = gemma3.ModelArgs.from_gguf(with_metadata(scaled, block_count=62, **shape))
    assert big.query_pre_attn_scalar == 168
    assert gemma3.Attention(big, 0).scale == 168.0 ** -0.5
    four_b = gemma3.ModelArgs.from_gguf(with_metadata(scaled, block_count=34, **shape))
    assert gemma3.Attention(four_b, 0).scale == 128.0 ** -0.5


def test_the_factor_moves_the_logits_through_the_global_layer_only(scaled, tmp_path):
    """The same weights with and without scaling: six layers (one global) score differently;
    their first five (all sliding) score the same, bit for bit."""
    ids = [int(t) for t in np.random.default_rng(0).integers(3, 300, 60)]
    plain = with_metadata(scaled, rope__scaling__type="none")
    six = [logits_alone(gemma3.load(g), ids, len(ids)) for g in (scaled, plain)]
    assert float(np.abs(six[0] - six[1]).max()) > 1e-2 * float(np.abs(six[1]).max())
    five = read_gguf(write_tiny_gemma3(tmp_path / "five.gguf", head_dim=256, n_layers=5,
                                       rope_scaling_factor=FACTOR))
    got = [logits_alone(gemma3.load(g), ids, len(ids))
           for g in (five, with_metadata(five, rope__scaling__type="none"))]
    np.testing.assert_array_equal(got[0], got[1])


@pytest.mark.parametrize("packed", [False, True], ids=["one-job", "packed"])
def test_the_compiled_graphs_and_the_heads_step_apply_the_scale(scaled, monkeypatch, packed):
    """The compiled `_pre` and the ``heads`` step (a kernel on CUDA) rotate the global
    layer's rows at its scale: each job scores as the module forward does."""
    model = gemma3.load(scaled)
    rng = np.random.default_rng(3)
    jobs = [[int(t) for t in rng.integers(3, 300, n)] for n in (50, 23)]
    for heads_min in (1 << 40, 1):  # in `_pre`, then in the ``heads`` step
        monkeypatch.setattr(_gemma3_graph, "HEADS_KERNEL_MIN", heads_min)
        forward = GraphForward(mlx_attend, mlx_attend_packed, None, mlx_heads)
        assert_scores_as_alone(model, forward, jobs, 20, packed)
    assert mx.default_device() == mx.cpu  # the module forward is the reference here
