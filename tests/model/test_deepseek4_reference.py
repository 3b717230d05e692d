"""The tiny DeepSeek-V4 GGUF writer (docs/deepseek4-tiny.md) and the float64 NumPy reference."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFWriter

from model.gguf.reader import GGUFError, read_gguf
from model.gguf.synthetic import DEEPSEEK4_TINY, write_tiny_deepseek4
from tests.model.deepseek4_reference import (
    apply_rope,
    compress,
    load_config,
    reference_all_logits,
    reference_logits,
    rope_frequencies,
)

V, H, HC, NH, HD, QR, ORANK, OG, IH, IHD, E, K, F = 299, 64, 4, 4, 32, 16, 16, 2, 2, 16, 4, 2, 32
RATIOS = [0, 0, 4, 128, 4, 128]
# Prompt seed chosen so the fixed prompt has no near-ties: argmax margin, indexer top-k and
# router top-k gaps are all far above float32 rounding (asserted below).
PROMPT = [0] + [int(t) for t in np.random.default_rng(7).integers(2, V, 299)]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return read_gguf(write_tiny_deepseek4(tmp_path_factory.mktemp("ds4") / "tiny.gguf"))


@pytest.fixture(scope="module")
def run(gguf):
    trace: dict = {}
    return reference_logits(gguf, PROMPT, trace), trace


def _expected_shapes() -> dict[str, tuple[int, ...]]:
    """docs/deepseek4-tiny.md's tensor table, spelled out independently of the writer."""
    shapes = {
        "token_embd.weight": (V, H),
        "output.weight": (V, H),
        "output_norm.weight": (H,),
        "output_hc_fn.weight": (HC, HC * H),
        "output_hc_base.weight": (HC,),
        "output_hc_scale.weight": (1,),
    }
    for i, r in enumerate(RATIOS):
        p = f"blk.{i}."
        shapes.update({
            p + "attn_norm.weight": (H,), p + "ffn_norm.weight": (H,),
            p + "hc_attn_fn.weight": (24, 4 * H), p + "hc_ffn_fn.weight": (24, 4 * H),
            p + "hc_attn_base.weight": (24,), p + "hc_ffn_base.weight": (24,),
            p + "hc_attn_scale.weight": (3,), p + "hc_ffn_scale.weight": (3,),
            p + "attn_q_a.weight": (QR, H), p + "attn_q_a_norm.weight": (QR,),
            p + "attn_q_b.weight": (NH * HD, QR),
            p + "attn_kv.weight": (HD, H), p + "attn_kv_a_norm.weight": (HD,),
            p + "attn_output_a.weight": (OG * ORANK, NH * HD // OG),
            p + "attn_output_b.weight": (H, OG * ORANK),
            p + "attn_sinks.weight": (NH,),
            p + "ffn_gate_inp.weight": (E, H),
            p + "ffn_gate_exps.weight": (E, F, H), p + "ffn_up_exps.weight": (E, F, H),
            p + "ffn_down_exps.weight": (E, H, F),
            p + "ffn_gate_shexp.weight": (F, H), p + "ffn_up_shexp.weight": (F, H),
            p + "ffn_down_shexp.weight": (H, F),
        })  # fmt: skip
        if r:
            coff = 2 if r == 4 else 1
            shapes.update({
                p + "attn_compressor_ape.weight": (r, coff * HD),
                p + "attn_compressor_kv.weight": (coff * HD, H),
                p + "attn_compressor_gate.weight": (coff * HD, H),
                p + "attn_compressor_norm.weight": (HD,),
            })  # fmt: skip
        if r == 4:
            shapes.update({
                p + "indexer.attn_q_b.weight": (IH * IHD, QR),
                p + "indexer.proj.weight": (IH, H),
                p + "indexer_compressor_ape.weight": (4, 2 * IHD),
                p + "indexer_compressor_kv.weight": (2 * IHD, H),
                p + "indexer_compressor_gate.weight": (2 * IHD, H),
                p + "indexer_compressor_norm.weight": (IHD,),
            })  # fmt: skip
        if i < 2:
            shapes[p + "ffn_gate_tid2eid.weight"] = (V, K)
        else:
            shapes[p + "exp_probs_b.bias"] = (E,)
    return shapes


def test_writer_tensors_match_the_doc(gguf):
    expected = _expected_shapes()
    assert set(gguf.tensor_types) == set(expected)
    for name, shape in expected.items():
        t = gguf.tensor(name)
        assert t.shape == shape, name
        assert t.dtype == (np.int32 if "tid2eid" in name else np.float32), name
        assert np.all(np.isfinite(t)), name
    for i in range(2):
        ids = gguf.tensor(f"blk.{i}.ffn_gate_tid2eid.weight")
        assert gguf.tensor_types[f"blk.{i}.ffn_gate_tid2eid.weight"] == "I32"
        assert ids.min() >= 0 and ids.max() < E
        assert all(len(set(row)) == K for row in ids.tolist()), "expert ids repeat in a row"


def test_writer_metadata_and_vocab(gguf):
    meta = gguf.metadata
    assert gguf.architecture == "deepseek4"
    doc = {
        "block_count": 6, "embedding_length": 64, "attention.head_count": 4,
        "attention.head_count_kv": 1, "attention.key_length": 32, "attention.value_length": 32,
        "rope.dimension_count": 8, "rope.freq_base": 10000.0,
        "attention.compress_rope_freq_base": 160000.0, "rope.scaling.type": "yarn",
        "rope.scaling.factor": 16.0, "rope.scaling.original_context_length": 65536,
        "rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0,
        "attention.q_lora_rank": 16, "attention.output_lora_rank": 16,
        "attention.output_group_count": 2, "attention.sliding_window": 16,
        "attention.compress_ratios": RATIOS, "attention.indexer.head_count": 2,
        "attention.indexer.key_length": 16, "attention.indexer.top_k": 3, "expert_count": 4,
        "expert_used_count": 2, "expert_shared_count": 1, "expert_feed_forward_length": 32,
        "expert_weights_scale": 1.5, "expert_weights_norm": True, "expert_gating_func": 4,
        "hash_layer_count": 2, "swiglu_clamp_exp": 10.0, "hyper_connection.count": 4,
        "hyper_connection.sinkhorn_iterations": 20, "hyper_connection.epsilon": 1e-6,
        "attention.layer_norm_rms_epsilon": 1e-6, "context_length": 4096,
        "embedding_length_out": 256,
    }  # fmt: skip
    assert set(doc) == set(DEEPSEEK4_TINY)
    for key, value in doc.items():
        got = meta[f"deepseek4.{key}"]
        assert got == (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value), key

    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "deepseek-v3"
    assert meta["tokenizer.ggml.add_bos_token"] is True
    assert tokens[meta["tokenizer.ggml.bos_token_id"]] == "<｜begin▁of▁sentence｜>"
    assert tokens[meta["tokenizer.ggml.eos_token_id"]] == "<｜end▁of▁sentence｜>"
    assert len(tokens) == len(set(tokens)) == V == gguf.tensor("token_embd.weight").shape[0]
    assert [i for i, t in enumerate(types) if t == 3] == [0, 1]
    assert "Ġ" in tokens and "Ġthe" in tokens and "Ġand" in tokens
    merges = meta["tokenizer.ggml.merges"]
    assert len(merges) >= 40
    for merge in merges:
        left, right = merge.split(" ")
        assert left in tokens and right in tokens and left + right in tokens, merge


def test_loader_reads_i32_and_names_unsupported_types(tmp_path):
    path = tmp_path / "ints.gguf"
    writer = GGUFWriter(str(path), "test")
    writer.add_tensor("ids", np.arange(6, dtype=np.int32).reshape(2, 3))
    writer.add_tensor("small", np.arange(4, dtype=np.int16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    g = read_gguf(path)
    ids = g.tensor("ids")
    assert ids.dtype == np.int32 and ids.tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(GGUFError, match="I16"):
        g.tensor("small")


def test_yarn_frequencies_for_tiny_rope(gguf):
    cfg = load_config(gguf)
    plain = 1.0 / 160000.0 ** (np.arange(0, 8, 2) / 8)
    # corr dims for d=8, base 160000, orig 65536: beta_fast 32 -> 1.93 (floor 1), beta_slow 1
    # -> 3.09 (ceil 4); ramp over pairs 0..3 = [0, 0, 1/3, 2/3], smooth = 1 - ramp.
    smooth = np.array([1.0, 1.0, 2 / 3, 1 / 3])
    expected = plain / 16 * (1 - smooth) + plain * smooth
    np.testing.assert_allclose(rope_frequencies(cfg, compressed=True), expected, rtol=1e-12)
    np.testing.assert_allclose(
        rope_frequencies(cfg, compressed=False), 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)
    )


def test_rope_rotates_only_the_last_dims_and_inverts():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 16))
    freqs, pos = np.array([1.0, 0.1, 0.01, 0.001]), np.arange(5) * 7
    y = apply_rope(x, pos, freqs)
    np.testing.assert_array_equal(y[..., :8], x[..., :8])
    assert not np.allclose(y[1:, :, 8:], x[1:, :, 8:])
    pair_norm = (y[..., 8::2] ** 2 + y[..., 9::2] ** 2) - (x[..., 8::2] ** 2 + x[..., 9::2] ** 2)
    np.testing.assert_allclose(pair_norm, 0, atol=1e-12)
    np.testing.assert_allclose(apply_rope(y, pos, freqs, inverse=True), x, atol=1e-12)


@pytest.mark.parametrize("ratio", [4, 128])
def test_compressor_row_j_sees_only_tokens_before_j_plus_1_times_r(ratio):
    rng = np.random.default_rng(1)
    d, hidden, n = 8, 12, 3 * ratio + 2
    coff = 2 if ratio == 4 else 1
    args = (
        rng.standard_normal((coff * d, hidden)), rng.standard_normal((coff * d, hidden)),
        rng.standard_normal((ratio, coff * d)), np.ones(d),
    )  # fmt: skip
    freqs = np.array([0.5, 0.05])

    def rows(x):
        return compress(x, *args, ratio, d, freqs, 1e-6)

    x = rng.standard_normal((n, hidden))
    base = rows(x)
    assert base.shape == (n // ratio, d)
    np.testing.assert_allclose(rows(x[: 2 * ratio + 1]), base[:2], atol=1e-12)
    x2 = x.copy()
    x2[ratio + 1] += 1.0  # a token of window 1
    changed = np.any(np.abs(rows(x2) - base) > 1e-9, axis=1)
    # window 1 feeds row 1 and, through the overlapping A-halves, row 2 when ratio == 4
    assert changed.tolist() == [False, True, ratio == 4]


def test_reference_logits_finite_and_deterministic(gguf, run):
    logits, _ = run
    assert logits.shape == (V,) and logits.dtype == np.float64
    assert np.all(np.isfinite(logits)) and 0.1 < np.abs(logits).max() < 100
    np.testing.assert_array_equal(reference_logits(gguf, PROMPT), logits)


def test_sinkhorn_comb_is_doubly_stochastic(run):
    _, trace = run
    assert len(trace["comb"]) == 2 * len(RATIOS)
    for comb in trace["comb"]:
        assert comb.shape == (len(PROMPT), HC, HC) and comb.min() > 0
        np.testing.assert_allclose(comb.sum(-1), 1, atol=1e-4)
        np.testing.assert_allclose(comb.sum(-2), 1, atol=1e-4)


def test_indexer_selects_top_k_of_visible_rows(run):
    _, trace = run
    assert len(trace["indexer"]) == RATIOS.count(4)
    n = len(PROMPT)
    visible_rows = (np.arange(n) + 1) // 4
    for layer in trace["indexer"]:
        np.testing.assert_array_equal(layer["visible"], visible_rows)
        assert visible_rows[-1] > 3, "the prompt must be long enough for the indexer to select"
        selected = layer["selected"]
        np.testing.assert_array_equal(selected.sum(1), np.minimum(3, visible_rows))
        assert not np.any(selected & (np.arange(selected.shape[1])[None] >= visible_rows[:, None]))
        assert layer["min_gap"] > 1e-3, "near-tie at the top-k boundary: pick another prompt"
    assert min(trace["router_min_gap"]) > 1e-4


def test_argmax_margin(run):
    logits, _ = run
    top2 = np.sort(logits)[-2:]
    assert top2[1] - top2[0] > 1e-3 * np.abs(logits).max()


def test_causal_changing_a_token_leaves_earlier_positions_unchanged(gguf):
    ids = PROMPT[:150]
    changed = list(ids)
    p = 133  # inside a ratio-4 window and ratio-128 window 1 (row 1 never visible here)
    changed[p] = (ids[p] + 1 - 2) % (V - 2) + 2
    a, b = reference_all_logits(gguf, ids), reference_all_logits(gguf, changed)
    np.testing.assert_allclose(a[:p], b[:p], rtol=0, atol=1e-12)
    assert np.all(np.abs(a[p:] - b[p:]).max(axis=1) > 1e-9)
