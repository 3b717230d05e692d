"""A tiny Gemma 3 and its weights under HF's (and mlx-lm's) names, for the peers' tests:
each peer, given prefillq's weights, must compute prefillq's logits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from bench.gpu_peers import shapes_of
from bench.prefill import HF_NAMES
from model.archs import gemma3
from model.start import start_prefill

# One global layer in six, a 16-token window that 80-token prompts in 32-token chunks cross,
# and a hidden size whose square root bf16 holds exactly (mlx-lm rounds it to bf16).
TINY = gemma3.ModelArgs(
    hidden_size=64, num_hidden_layers=6, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=1, head_dim=32, vocab_size=512, rms_norm_eps=1e-6, sliding_window=16,
    rope_theta=1_000_000.0, context_length=256)
TINY_SHAPES = shapes_of(TINY, "gemma3 tiny")
# Gemma 3 27B's kind: the global layer's positions scaled by 1/8 (linear RoPE scaling) and
# the queries by 1/sqrt(48) instead of 1/sqrt(head_dim)
TINY_SCALED = replace(TINY, rope_scale=0.125, query_pre_attn_scalar=48)
N, CHUNK = 80, 32
PROMPT = [(7 * i + 3) % TINY.vocab_size for i in range(N)]
# float32 on the CPU, the same equations in another order: max |diff| / max |logit|
# measures ~1e-6; a wrong scale, RoPE base, window or norm moves it by 1e-2 or more.
SAME_FUNCTION_RTOL = 1e-4


def prefillq_tiny(args: gemma3.ModelArgs = TINY) -> gemma3.Model:
    """prefillq's Gemma 3 at `args` (`TINY`'s sizes), float32, random weights (norms too)
    from seed 1."""
    mx.random.seed(1)
    model = gemma3.Model(args)
    # random norm weights (prefillq's multiply by w; HF's and mlx-lm's by 1 + w)
    norms = {k: 1 + 0.3 * mx.random.normal(v.shape) for k, v in
             tree_flatten(model.parameters()) if "norm" in k}
    model.load_weights(list(norms.items()), strict=False)
    mx.eval(model.parameters())
    return model


def their_weights(model: gemma3.Model) -> dict[str, np.ndarray]:
    """`model`'s weights under HF's names, norms as HF stores them (w - 1)."""
    ours = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    theirs = {"model.embed_tokens.weight": ours["token_embd.weight"],
              "model.norm.weight": ours["output_norm.weight"] - 1}
    for i in range(TINY.num_hidden_layers):
        for mine, hf in HF_NAMES.items():
            w = ours[f"blk.{i}.{mine}.weight"]
            theirs[f"model.layers.{i}.{hf}.weight"] = w - 1 if "norm" in mine else w
    assert len(theirs) == len(ours)
    return theirs


def prefillq_logits(model: gemma3.Model, ids: list[int]) -> np.ndarray:
    return start_prefill(model, ids, vocab_size=TINY.vocab_size,
                         context_length=TINY.context_length, chunk_tokens=CHUNK).run()


def relative_gap(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def assert_computes_prefillq(ours: gemma3.Model,
                             theirs: Callable[[list[int]], np.ndarray]) -> np.ndarray:
    """`theirs` (token ids -> final-position logits, ``(vocab,)``) gives `ours`' logits on
    `PROMPT` within `SAME_FUNCTION_RTOL`; returns them."""
    got = theirs(PROMPT)
    assert got.shape == (TINY.vocab_size,)
    assert relative_gap(got, prefillq_logits(ours, PROMPT)) < SAME_FUNCTION_RTOL
    return got
