"""The Llama family (`model.archs.llama`) on its tiny GGUFs (`variants`), float32 on CPU: each
against the float64 reference (`tests.model.llama_reference`), chunked prefill equal to one
pass, exact cache snapshots and states, a session turn equal to a cold prefill, the
registry's names.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from model.archs import llama
from model.gguf.reader import read_gguf
from model.gguf.synthetic.llama import LLAMA_TINY, QWEN2_TINY, TINY_LLAMAS, write_tiny_llama
from model.planner import ChunkPlan, plan_chunks
from model.registry import load_model, plan_for
from tests.model import llama_reference as reference
from tests.model.session_harness import Harness
from tests.model.test_gemma3 import report

# The contract (tests/exactness.py): max |diff| <= 1e-3 x max |logit| and the same argmax.
EXACT_RTOL = 1e-3
# Regression bounds on max |diff| / max |logit|, ~4x the worst measured over the variants:
# float32 MLX vs the float64 reference (every position of 300 tokens) measures 3.6e-7 to
# 6.6e-7; chunked vs one pass (333 tokens in chunks of 7, 64, 300) 1.8e-7 to 8.1e-7; the
# session turns 3.9e-7 to 6.9e-7.
REFERENCE_BOUND = 3e-6
CHUNKED_BOUND = 3e-6
# A model with one part of its variant removed is at least this far from the reference
# (measured: 0.083 for Qwen 3 without q/k norms to 0.96 for Qwen 2 without biases; 0.27
# for llama-tiny without rope_freqs).
ABLATED_MIN = 3e-2
N_REFERENCE, N_CHUNKED = 300, 333
WINDOW = replace(LLAMA_TINY, name="prefillq tiny llama window", llama3=None, n_kv_heads=4,
                 head_dim=16, tied=True, extra_biases=True, sliding_window=16,
                 sliding_pattern=(True, True, False, True))
LINEAR = replace(QWEN2_TINY, name="prefillq tiny qwen2 linear", linear_factor=4.0)
VARIANTS = [*TINY_LLAMAS, "window", "linear"]


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """name -> (LoadedModel, its GGUFFile): registered ones by name, the others by path.

    The registered ``llama-tiny`` (Llama 3 RoPE scaling, separate head), ``qwen2-tiny``
    (q/k/v biases), ``qwen3-tiny`` (q/k norms, head dim 128, tied head), and two written
    here: ``window`` (a 16-token window on three of four layers, attention output and MLP
    biases, MHA) and ``linear`` (Qwen 2 with linear RoPE scaling, factor 4). The 333-token
    prompts wrap the window's rings many times; chunks of 7 and 64 start inside a window and
    cross it.
    """
    out = {}
    for name in TINY_LLAMAS:
        loaded = load_model(name)
        out[name] = loaded, read_gguf(loaded.path)
    folder = tmp_path_factory.mktemp("llama")
    for name, config in (("window", WINDOW), ("linear", LINEAR)):
        path = write_tiny_llama(folder / f"{name}.gguf", config)
        out[name] = load_model(f"{name}={path}"), read_gguf(path)
    return out


@pytest.fixture(scope="module")
def measured(request):
    ratios: dict[str, float] = {}
    yield ratios
    report(request, [f"llama {name}: max|diff| / max|logit| {r:.3g}" for name, r in ratios.items()])


def ids(loaded, n: int, seed: int = 1) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, loaded.vocab_size, n)]


def every_logit(model, token_ids: list[int]) -> np.ndarray:
    """float32 ``(n, vocab)``: the model on the whole prompt in one pass, every position."""
    hidden = model(mx.array([token_ids]), model.make_cache(), every_position=True)
    return np.array(model.logits(hidden)[0].astype(mx.float32))


def ratio(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def assert_margin(ref: np.ndarray) -> None:
    top2 = np.sort(ref)[-2:]
    assert top2[1] - top2[0] > 2 * EXACT_RTOL * np.abs(ref).max(), "argmax near-tie"


# --- against the float64 reference -------------------------------------------------------


@pytest.mark.parametrize("name", VARIANTS)
def test_every_position_matches_the_float64_reference(variants, measured, name):
    loaded, gguf = variants[name]
    prompt = ids(loaded, N_REFERENCE)
    ref = reference.forward(gguf, prompt, every_position=True)
    got = every_logit(loaded.model, prompt)
    measured[f"{name} vs reference"] = r = ratio(got, ref)
    assert_margin(ref[-1])
    assert r <= EXACT_RTOL and r <= REFERENCE_BOUND, f"{r:.3g}"
    assert (got.argmax(axis=-1) == ref.argmax(axis=-1)).mean() > 0.99


# each variant's own part, removed: the rotation convention (NEOX on a NORM file), q/k/v
# biases, q/k norms, the window, linear scaling
ABLATIONS = {"llama-tiny": {"rope_traditional": False}, "qwen2-tiny": {"attention_bias": False},
             "qwen3-tiny": {"qk_norm": False}, "window": {"sliding_window": 0},
             "linear": {"rope_scale": 1.0}}


@pytest.mark.parametrize("name", VARIANTS)
def test_the_reference_sees_each_variants_part(variants, measured, name):
    """The same weights without the variant's part (rotation convention, biases, q/k norm,
    window, linear scaling) are far from the reference: the reference checks that part."""
    loaded, gguf = variants[name]
    args = replace(loaded.model.args, **ABLATIONS[name])
    model = llama.Model(args, gguf.tensor(llama.ROPE_FREQS) if args.rope_freqs else None)
    model.load_weights(nn.utils.tree_flatten(loaded.model.parameters()), strict=False)
    prompt = ids(loaded, N_REFERENCE)
    r = ratio(every_logit(model, prompt), reference.forward(gguf, prompt, every_position=True))
    measured[f"{name} ablated vs reference"] = r
    assert r >= ABLATED_MIN


def test_leaving_rope_freqs_out_changes_the_logits(variants, tmp_path, measured):
    loaded, _ = variants["llama-tiny"]
    path = write_tiny_llama(tmp_path / "no-freqs.gguf", LLAMA_TINY, rope_freqs=False)
    plain = load_model(f"plain={path}")
    assert loaded.model.args.rope_freqs and not plain.model.args.rope_freqs
    prompt = ids(loaded, N_REFERENCE)
    scaled, unscaled = every_logit(loaded.model, prompt), every_logit(plain.model, prompt)
    measured["llama-tiny without rope_freqs vs with"] = r = ratio(unscaled, scaled)
    assert r >= ABLATED_MIN
    assert ratio(unscaled, reference.forward(read_gguf(path), prompt, True)) <= REFERENCE_BOUND


def hf_llama3_inv_freq(base: float, dims: int, factor: float, low: float, high: float,
                       original: int) -> np.ndarray:
    """HF transformers' ``_compute_llama3_parameters`` (modeling_rope_utils.py)."""
    inv_freq = 1.0 / base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return np.where(medium, smoothed, scaled)


def test_rope_freqs_follow_llama3s_rule(variants):
    _, gguf = variants["llama-tiny"]
    s, c = LLAMA_TINY.llama3, LLAMA_TINY
    factors = gguf.tensor(llama.ROPE_FREQS).astype(np.float64)
    hf = hf_llama3_inv_freq(c.rope_base, c.head_dim, s.factor, s.low_freq_factor,
                            s.high_freq_factor, s.original_context)
    plain = 1.0 / c.rope_base ** (np.arange(0, c.head_dim, 2) / c.head_dim)
    np.testing.assert_allclose(plain / factors, hf, rtol=1e-6)
    # the tiny config reaches all three regimes: unscaled, blended and fully scaled pairs
    assert (factors == 1).any() and (factors == s.factor).any()
    assert ((factors > 1) & (factors < s.factor)).any()


def test_norm_rope_on_permuted_weights_is_hf_rotate_half():
    """llama.cpp's converter permutes HF's q/k rows (``LlamaModel.permute``) so that the
    NORM rotation of adjacent pairs equals HF's rotate-half on the original rows: the
    attention scores agree (the reference's convention for ``llama`` is the right one)."""
    rng = np.random.default_rng(0)
    n, heads, d, dim = 12, 2, 8, 16
    w_hf = rng.standard_normal((heads * d, dim))
    w_gguf = w_hf.reshape(heads, 2, d // 2, dim).swapaxes(1, 2).reshape(w_hf.shape)
    x = rng.standard_normal((n, dim))
    angles = np.arange(n)[:, None] * 10_000.0 ** (-np.arange(0, d, 2) / d)[None, :]

    def hf_rope(y):  # HF: q * cos + rotate_half(q) * sin, cos/sin of [angles, angles]
        cos, sin = np.cos(np.tile(angles, 2))[:, None], np.sin(np.tile(angles, 2))[:, None]
        return y * cos + np.concatenate([-y[..., d // 2:], y[..., : d // 2]], -1) * sin

    hf = hf_rope((x @ w_hf.T).reshape(n, heads, d))
    ours = reference.apply_rope((x @ w_gguf.T).reshape(n, heads, d), angles, neox=False)
    np.testing.assert_allclose(np.einsum("ihd,jhd->hij", ours, ours),
                               np.einsum("ihd,jhd->hij", hf, hf), atol=1e-10)


# --- chunked prefill equals one pass -------------------------------------------------------


@pytest.fixture(scope="module")
def one_pass(variants):
    out = {}
    for name, (loaded, _) in variants.items():
        prefill = loaded.start_prefill(ids(loaded, N_CHUNKED, seed=2), chunk_tokens=N_CHUNKED)
        out[name] = prefill.run()
        assert prefill.chunks_done == 1
    return out


@pytest.mark.parametrize("chunk", [7, 64, 300])
@pytest.mark.parametrize("name", VARIANTS)
def test_chunked_prefill_equals_one_pass(variants, one_pass, measured, name, chunk):
    loaded, _ = variants[name]
    prefill = loaded.start_prefill(ids(loaded, N_CHUNKED, seed=2), chunk_tokens=chunk)
    got, ref = prefill.run(), one_pass[name]
    assert prefill.chunks_done == -(-N_CHUNKED // chunk)
    measured[f"{name} chunks of {chunk}"] = r = ratio(got, ref)
    assert_margin(ref)
    assert r <= EXACT_RTOL and r <= CHUNKED_BOUND, f"{r:.3g}"
    assert int(got.argmax()) == int(ref.argmax())


def test_a_model_without_a_window_plans_default_chunks(variants):
    loaded, _ = variants["llama-tiny"]
    assert loaded.sliding_window == 0  # the planner's token granularity
    assert plan_chunks(2300, loaded.sliding_window).chunk_sizes == (2048, 252)
    assert plan_chunks(5000, loaded.sliding_window).chunk_sizes == (1667, 1667, 1666)
    specs = loaded.model.args.layer_specs()
    assert [s.window for s in specs] == [None] * 4 and specs[0].head_dim == 32
    window, _ = variants["window"]
    assert [s.window for s in window.model.args.layer_specs()] == [16, 16, None, 16]


# --- cache: snapshot/restore and state round trips ------------------------------------------


@pytest.mark.parametrize("name", ["llama-tiny", "window"])
def test_snapshot_restore_and_state_round_trips_are_bitwise(variants, name):
    loaded, _ = variants[name]
    prompt = ids(loaded, N_CHUNKED, seed=3)
    plan = ChunkPlan.from_boundaries(N_CHUNKED, [40, 101, 250, N_CHUNKED])
    straight = loaded.start_prefill(prompt, plan=plan).run()

    prefill = loaded.start_prefill(prompt, plan=plan)
    prefill.step()
    prefill.step()
    snapshot = prefill.cache.snapshot()
    prefill.step()  # rewrites the rings past the snapshot
    prefill.cache.restore(snapshot)
    assert prefill.cursor == 101
    np.testing.assert_array_equal(prefill.run(), straight)

    partial = loaded.start_prefill(prompt, plan=plan)
    partial.step()
    partial.step()
    resumed = loaded.resume_prefill(prompt, plan, partial.cache.state())
    assert resumed.cursor == 101
    np.testing.assert_array_equal(resumed.run(), straight)


def test_a_state_of_another_architecture_is_refused(variants):
    from model.cache import CacheStateError

    qwen2, _ = variants["qwen2-tiny"]
    llama_tiny, _ = variants["llama-tiny"]
    prefill = qwen2.start_prefill(ids(qwen2, 50), chunk_tokens=20)
    prefill.step()
    with pytest.raises(CacheStateError, match="architecture"):
        llama_tiny.model.cache_from_state(prefill.cache.state())


# --- sessions and the registry ----------------------------------------------------------------


def test_a_session_turn_on_llama_tiny_equals_cold(variants, measured):
    loaded, _ = variants["llama-tiny"]
    text, other = ids(loaded, 600, seed=4), ids(loaded, 600, seed=5)
    h = Harness(loaded, text, other, n1=150, chunk=64, step=64, bound=CHUNKED_BOUND)
    _, slot = h.first_turn()
    ids2 = text[:260]
    prefill, same = h.turn(slot, ids2)
    # the slot's cache grows (64-token steps) and keeps its live prefix
    assert same is slot and (prefill.reuse, prefill.cached_tokens) == ("grow-live", 150)
    prefill.run()
    h.check("live follow-up", prefill, ids2)
    edited = ids2[:-8] + other[:30]  # the chat template rewrote the tail: the turn anchor
    prefill, _ = h.turn(slot, edited)
    assert prefill.reuse.endswith("recovery-anchor") and prefill.cached_tokens == len(ids2) - 8
    prefill.run()
    h.check("anchor rollback", prefill, edited)
    measured.update({f"llama-tiny session {k}": v for k, v in h.diffs.items()})


@pytest.mark.parametrize("name", sorted(TINY_LLAMAS))
def test_the_registry_loads_each_tiny_model_by_name(variants, name):
    loaded, gguf = variants[name]
    config = TINY_LLAMAS[name]
    assert loaded.name == name and loaded.architecture == config.architecture
    assert gguf.metadata["general.name"] == config.name
    assert loaded.vocab_size == len(gguf.metadata["tokenizer.ggml.tokens"])
    assert loaded.tokenizer.encode("the tiny model", add_bos=False)
    args = loaded.model.args
    assert (args.rope_traditional, args.tie_word_embeddings) == (
        config.architecture == "llama", config.tied)
    assert (args.attention_bias, args.qk_norm, args.rope_freqs) == (
        config.biases, config.qk_norm, config.llama3 is not None)
    plan = plan_for(name, 100, mx.float32)  # from the GGUF's metadata, no weights
    assert plan == llama.cache_plan(args, 100, mx.float32)
    assert plan.bytes_per_token == config.n_layers * 2 * config.n_kv_heads * config.head_dim * 4
