"""`bench.gpu_peer_mlx_lm`, where mlx-lm is installed (it is not a test dependency): its
Gemma 3 at prefillq's shapes computes prefillq's function, and its cases record."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from bench import gpu_peer_mlx_lm, gpu_peers
from bench.gpu_peers import shapes_of
from tests.bench.tiny_gemma import (
    CHUNK,
    PROMPT,
    SAME_FUNCTION_RTOL,
    TINY,
    TINY_SCALED,
    TINY_SHAPES,
    N,
    assert_computes_prefillq,
    prefillq_tiny,
    relative_gap,
    their_weights,
)


@pytest.mark.parametrize("args", [TINY, TINY_SCALED], ids=["tiny", "scaled"])
def test_mlx_lm_prefills_the_same_function_as_prefillq(args):
    """mlx-lm's Gemma 3 with prefillq's weights gives prefillq's logits, also with the
    global layer's RoPE linearly scaled and 27B's kind of query scale."""
    pytest.importorskip("mlx_lm")
    ours = prefillq_tiny(args)
    peer = gpu_peer_mlx_lm.mlx_lm_model(shapes_of(args, "gemma3 tiny"), dtype=mx.float32)
    peer.load_weights([(k, mx.array(v)) for k, v in their_weights(ours).items()])
    theirs = assert_computes_prefillq(ours, lambda ids: np.array(
        gpu_peer_mlx_lm.mlx_lm_prefill(peer, mx.array(ids), CHUNK)[0]))
    # and its own full-vocabulary forward agrees with the last-position head
    full = np.array(peer(mx.array(PROMPT)[None])[0, -1])
    assert relative_gap(theirs, full) < SAME_FUNCTION_RTOL


def test_mlx_lm_cases_record_at_tiny_shapes():
    pytest.importorskip("mlx_lm")
    rec = gpu_peers.child_recorder(gpu_peers.MLX_LM, "mlx")
    gpu_peer_mlx_lm.mlx_lm_cases(rec, TINY_SHAPES, [(N, CHUNK)], repeats=1)
    (record,) = rec.records
    assert record["metric"] == "gpu_prefill_tok_s" and record["value"] > 0
    assert record["impl"] == gpu_peers.MLX_LM and record["mlx_lm"]
    assert (record["n_tokens"], record["chunk_tokens"], record["model"]) == (
        N, CHUNK, "gemma3 tiny")
