"""Gemma 3 270M (the real Q4_K_M GGUF, float32 on CPU): llama.cpp agreement, chunked prefill
equal to one pass, recovery from a failed chunk, and input errors.

llama.cpp agreement uses the reference token ids from tests/data, so it does not depend on
the tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from model.cache import CachePoisoned
from model.cache_plan import LayerSpec, plan_cache
from model.layer_cache import GlobalKVCache
from model.planner import DEFAULT_CHUNK_TOKENS
from model.start import start_prefill

# Agreement with llama.cpp's logits for the same ids (tests/data/gemma3-270m-llamacpp.json).
LLAMA_MIN_TOP5_OVERLAP = 4
LLAMA_MAX_TOP10_DIFF = 1.0
# Chunked vs one pass, the contract: max |diff| <= 1e-3 x max |logit|, identical argmax.
EXACT_RTOL = 1e-3
# ...and a regression bound on max |diff| (logits, float32 on CPU), ~5x the worst measured:
# 600 tokens in chunks of 7, 511, 513, 599 measure 5.9e-5, 3.4e-5, 2.4e-5, 4.0e-5; 40 tokens
# one by one 2.2e-5; 512-token chunks and 2,300 tokens as 2,048 + 252 measure 0.
CHUNKED_MAX_DIFF = 3e-4
# Longer than the 512-token window, short enough for CI on 2 cores (~12 s per pass).
N_EXACT = 600
N_SHORT = 40  # the chunk-size-1 prompt
N_PAST_DEFAULT = 2300  # default chunking splits it: 2,048 + 252
DATA = Path(__file__).parents[1] / "data"
N_CASES = len(json.loads((DATA / "gemma3-270m-llamacpp.json").read_text())["cases"])


def report(request, lines: list[str]) -> None:
    """Write measurements to the terminal, past output capture, when a module fixture ends."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None or not lines:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        for line in lines:
            reporter.write_line(line)


@pytest.fixture(scope="module")
def llama_gaps(request):
    """Measured llama.cpp gaps per case, written to the terminal when the module ends."""
    gaps: dict[str, str] = {}
    yield gaps
    report(request, [f"gemma3 vs llama.cpp {case}: {line}" for case, line in gaps.items()])


@pytest.fixture(scope="module")
def chunk_diffs(request):
    diffs: dict[str, str] = {}
    yield diffs
    report(request, [f"gemma3 chunked vs one pass, {name}: {line}" for name, line in diffs.items()])


@pytest.fixture(scope="module")
def long_ids(reference_cases) -> list[int]:
    """The first `N_EXACT` reference ids of the first case at least that long."""
    case = next(c for c in reference_cases if len(c["tokens"]) >= N_EXACT)
    return case["tokens"][:N_EXACT]


def one_pass(gemma, ids: list[int]) -> np.ndarray:
    prefill = gemma.start_prefill(ids, chunk_tokens=len(ids))
    logits = prefill.run()
    assert prefill.chunks_done == 1
    return logits


@pytest.fixture(scope="module")
def long_reference(gemma, long_ids) -> np.ndarray:
    return one_pass(gemma, long_ids)


@pytest.fixture(scope="module")
def short_reference(gemma, long_ids) -> np.ndarray:
    return one_pass(gemma, long_ids[:N_SHORT])


def tolerance(reference: np.ndarray) -> float:
    return EXACT_RTOL * float(np.abs(reference).max())


def assert_margin_exceeds(reference: np.ndarray, tol: float) -> None:
    """Top-1 minus top-2 must exceed the tolerance, or argmax equality would mean nothing."""
    top2 = np.sort(reference)[-2:]
    assert top2[1] - top2[0] > tol, f"top-1 margin {top2[1] - top2[0]:.4g} <= tolerance {tol:.4g}"


# --- shape of the real model ------------------------------------------------------------


def test_layer_specs_are_five_sliding_then_one_global(gemma):
    args = gemma.model.args
    assert gemma.sliding_window == 512
    assert args.num_hidden_layers == 18 and args.vocab_size == gemma.vocab_size == 262_144
    hand = [LayerSpec(1, 256, None if (i + 1) % 6 == 0 else 512) for i in range(18)]
    assert args.layer_specs() == hand
    plan = gemma.model.make_cache().plan()
    assert plan.bytes_per_token == plan_cache(hand, 1, gemma.dtype).bytes_per_token
    assert plan.context_length == args.context_length


# --- agreement with llama.cpp -----------------------------------------------------------


@pytest.fixture(scope="module")
def logits_by_tokens(gemma):
    """Our final logits per distinct token list (two reference cases share their ids)."""
    memo: dict[tuple[int, ...], np.ndarray] = {}

    def compute(ids: list[int]) -> np.ndarray:
        key = tuple(ids)
        if key not in memo:
            # one pass up to the default chunk; longer prompts use the default plan (their
            # exactness is checked separately and one pass of 6,144 tokens is slow on CPU)
            chunk = len(ids) if len(ids) <= DEFAULT_CHUNK_TOKENS else None
            memo[key] = gemma.start_prefill(ids, chunk_tokens=chunk).run()
        return memo[key]

    return compute


@pytest.mark.parametrize("case_index", range(N_CASES), ids=[f"case{i}" for i in range(N_CASES)])
def test_final_logits_match_llama_cpp(
    case_index, reference_cases, logits_by_tokens, llama_gaps, record_property
):
    case = reference_cases[case_index]
    ids = case["tokens"]
    logits = logits_by_tokens(ids)
    assert logits.shape == (262_144,) and logits.dtype == np.float32
    ref_ids = np.array(case["top10_ids"])
    ref_logits = np.array(case["top10_logits"], dtype=np.float32)
    ours_top5 = np.argsort(-logits)[:5]
    overlap = len(set(ours_top5.tolist()) & set(ref_ids[:5].tolist()))
    gap = float(np.abs(logits[ref_ids] - ref_logits).max())
    line = (
        f"{len(ids)} tokens, top-1 ours {int(logits.argmax())} llama {int(ref_ids[0])}, "
        f"top-5 overlap {overlap}/5, max |diff| on llama top-10 {gap:.3f}"
    )
    llama_gaps[f"case{case_index}"] = line
    record_property("top5_overlap", overlap)
    record_property("max_abs_diff_top10", gap)
    print(line)
    assert int(logits.argmax()) == int(ref_ids[0])
    assert overlap >= LLAMA_MIN_TOP5_OVERLAP
    assert gap <= LLAMA_MAX_TOP10_DIFF


# --- chunked prefill equals one pass ----------------------------------------------------


def test_exactness_prompt_is_longer_than_the_window(gemma, long_ids, long_reference):
    assert len(long_ids) == N_EXACT > gemma.sliding_window
    assert_margin_exceeds(long_reference, tolerance(long_reference))


@pytest.mark.parametrize(
    "chunk_tokens",
    [7, 511, 512, 513, None, N_EXACT - 1],
    ids=["7", "511", "512", "513", "default", "n-1"],
)
def test_chunked_prefill_equals_one_pass(
    gemma, long_ids, long_reference, chunk_tokens, chunk_diffs, record_property
):
    prefill = gemma.start_prefill(long_ids, chunk_tokens=chunk_tokens)
    size = chunk_tokens or DEFAULT_CHUNK_TOKENS
    assert prefill.plan.chunk_sizes[0] == min(size, N_EXACT)
    logits = prefill.run()
    assert prefill.chunks_done == -(-N_EXACT // min(size, N_EXACT))
    assert prefill.cursor == N_EXACT
    tol = tolerance(long_reference)
    diff = float(np.abs(logits - long_reference).max())
    chunk_diffs[f"n={N_EXACT} chunk={chunk_tokens or 'default'}"] = (
        f"max |diff| {diff:.3g} (tolerance {tol:.3g}), {prefill.chunks_done} chunks, "
        f"{prefill.compute_seconds:.1f} s"
    )
    record_property("max_abs_diff", diff)
    assert_margin_exceeds(long_reference, tol)
    assert diff <= tol
    assert diff <= CHUNKED_MAX_DIFF, f"max |diff| {diff:.3g} > {CHUNKED_MAX_DIFF}"
    assert int(logits.argmax()) == int(long_reference.argmax())


def test_chunk_size_one_equals_one_pass(gemma, long_ids, short_reference, chunk_diffs):
    prefill = gemma.start_prefill(long_ids[:N_SHORT], chunk_tokens=1)
    logits = prefill.run()
    assert prefill.chunks_done == N_SHORT
    tol = tolerance(short_reference)
    diff = float(np.abs(logits - short_reference).max())
    chunk_diffs[f"n={N_SHORT} chunk=1"] = f"max |diff| {diff:.3g} (tolerance {tol:.3g})"
    assert_margin_exceeds(short_reference, tol)
    assert diff <= tol
    assert diff <= CHUNKED_MAX_DIFF, f"max |diff| {diff:.3g} > {CHUNKED_MAX_DIFF}"
    assert int(logits.argmax()) == int(short_reference.argmax())


def test_default_chunks_of_a_prompt_longer_than_one_chunk_equal_one_pass(
    gemma, reference_cases, chunk_diffs
):
    ids = reference_cases[5]["tokens"][:N_PAST_DEFAULT]  # the 2,591-token case, truncated
    reference = one_pass(gemma, ids)
    prefill = gemma.start_prefill(ids)
    assert prefill.plan.chunk_sizes == (DEFAULT_CHUNK_TOKENS, N_PAST_DEFAULT - DEFAULT_CHUNK_TOKENS)
    logits = prefill.run()
    tol = tolerance(reference)
    diff = float(np.abs(logits - reference).max())
    chunk_diffs[f"n={N_PAST_DEFAULT} chunk=default"] = (
        f"max |diff| {diff:.3g} (tolerance {tol:.3g})"
    )
    assert_margin_exceeds(reference, tol)
    assert diff <= tol
    assert diff <= CHUNKED_MAX_DIFF, f"max |diff| {diff:.3g} > {CHUNKED_MAX_DIFF}"
    assert int(logits.argmax()) == int(reference.argmax())


# --- a failed chunk poisons the cache; reset and rerun --------------------------------


def test_failed_chunk_poisons_then_reset_reruns_exactly(gemma, long_ids, long_reference):
    prefill = gemma.start_prefill(long_ids, chunk_tokens=300)
    assert prefill.step() == 300
    # A real failure inside the forward, after the five sliding layers before it wrote
    # their rows: the first global layer's buffer has the wrong head width, so writing
    # the chunk's keys into it raises.
    cache = prefill.cache
    global_layer = next(i for i, spec in enumerate(cache.specs) if spec.window is None)
    assert global_layer > 0
    original = cache.layers[global_layer]
    cache.layers[global_layer] = GlobalKVCache(LayerSpec(1, 128), gemma.dtype, capacity=N_EXACT)
    with pytest.raises(ValueError):
        prefill.step()
    cache.layers[global_layer] = original
    assert cache.is_poisoned
    assert prefill.cursor == 300  # the failed chunk was not committed
    with pytest.raises(CachePoisoned):
        prefill.step()
    with pytest.raises(CachePoisoned):
        cache.snapshot()

    prefill.reset()
    assert prefill.cursor == 0 and prefill.chunks_done == 0 and not cache.is_poisoned
    logits = prefill.run()
    assert prefill.chunks_done == 2
    tol = tolerance(long_reference)
    diff = float(np.abs(logits - long_reference).max())
    assert diff <= tol
    assert diff <= CHUNKED_MAX_DIFF, f"max |diff| {diff:.3g} > {CHUNKED_MAX_DIFF}"
    assert int(logits.argmax()) == int(long_reference.argmax())


# --- input errors ----------------------------------------------------------------------


def test_empty_prompt(gemma):
    with pytest.raises(ValueError):
        gemma.start_prefill([])


@pytest.mark.parametrize("bad", [262_144, 10**9, -1])
def test_token_out_of_range(gemma, bad):
    with pytest.raises(ValueError):
        gemma.start_prefill([2, 818, bad, 5279])
    gemma.start_prefill([2, 818, 262_143, 5279])  # the last id is fine


def test_prompt_too_long(gemma):
    kwargs = {"vocab_size": gemma.vocab_size, "context_length": 10}
    with pytest.raises(ValueError):
        start_prefill(gemma.model, [2] * 11, **kwargs)
    prefill = start_prefill(gemma.model, [2] * 10, **kwargs)  # exactly the context is fine
    assert prefill.cache.context_length == 10


def test_input_errors_are_deterministic_value_errors(gemma):
    """The guard raises a plain ValueError for each input error, every time (the typed
    errors a client sees come from ``jobs.requests.check_token_ids``)."""
    kwargs = {"vocab_size": gemma.vocab_size, "context_length": 10}
    for ids in ([], [2, -1], [2] * 11):
        for _ in range(2):
            with pytest.raises(ValueError):
                start_prefill(gemma.model, ids, **kwargs)


@pytest.mark.parametrize("window", [16, None])
@pytest.mark.parametrize("block", [1, 5, 8, 16, 64])
@pytest.mark.parametrize("position,L", [(0, 50), (7, 50), (40, 33), (100, 17), (3, 16)])
def test_blocked_attention_equals_the_masked_one(position, L, block, window):
    """Windowed keys as `RingKVCache` returns them (the previous window - 1 rows), global
    keys as `GlobalKVCache` does (every earlier row)."""
    import mlx.core as mx

    from model.archs._attention import blocked_attention

    n_prev = min(position, window - 1) if window else position
    rng = np.random.default_rng(position * 100 + L)
    q = mx.array(rng.standard_normal((1, 4, L, 8)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 1, n_prev + L, 8)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, 1, n_prev + L, 8)).astype(np.float32))
    q_pos = mx.arange(position, position + L)[:, None]
    k_pos = mx.arange(position - n_prev, position + L)[None, :]
    mask = k_pos <= q_pos
    if window:
        mask = mask & (q_pos - k_pos < window)
    full = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.35, mask=mask)
    blocked = blocked_attention(q, k, v, 0.35, position, window, block=block)
    assert blocked.shape == full.shape
    assert float(mx.abs(blocked - full).max()) < 1e-5


def test_cpu_attention_blocks_follow_a_short_window():
    """On the CPU a sliding-window layer attends in blocks about its window's size (at least
    `MIN_CPU_BLOCK` queries), so a 16-token window does not score 512 keys per query."""
    import mlx.core as mx

    from model.archs._attention import MIN_CPU_BLOCK, attention_block, blocked_above

    with mx.stream(mx.cpu):
        if mx.default_device() != mx.cpu:
            pytest.skip("the CPU rule; the default device is a GPU")
        assert attention_block(None) == 512 == attention_block(512) == attention_block(4096)
        assert attention_block(100) == 100 == blocked_above(100)
        assert attention_block(16) == MIN_CPU_BLOCK == 64
