"""Several jobs' chunks in one packed forward pass (`Prefill.launch_all`, the models'
`model.archs._packed.PackedModel.packed`: Gemma 3 and the Llama family) give each job the
logits, and prompt log-probabilities, it gets alone (tests/exactness.py)."""

from __future__ import annotations

import numpy as np
import pytest

import model.prefill
from model.gguf.synthetic.llama import TINY_LLAMAS, write_tiny_llama
from model.planner import plan_chunks
from model.prefill import Prefill
from model.registry import load_model
from tests.exactness import assert_contract
from tests.model.test_llama import WINDOW

# the registered tiny Llamas (GQA 4/2 with Llama 3 RoPE, GQA 6/2 with q/k/v biases, q/k
# norms over one KV head) and test_llama's `window` (rings on 3 of 4 layers, MHA, biases)
LLAMAS = [*sorted(TINY_LLAMAS), "window"]
# max |diff| / max |logit| of a packed pass against the job alone, for the tiny Llamas' logits
# and the tiny models' prompt logprobs: 3-5x the worst measured (below)
PACKED_BOUND = 3e-6


@pytest.fixture(scope="module")
def llamas(tmp_path_factory) -> dict:
    """name -> `model.registry.LoadedModel` of each of `LLAMAS`."""
    out = {name: load_model(name) for name in TINY_LLAMAS}
    path = write_tiny_llama(tmp_path_factory.mktemp("llama") / "window.gguf", WINDOW)
    out["window"] = load_model(f"window={path}")
    return out


def prompt(loaded, n: int, seed: int) -> list[int]:
    """`n` ids: Gemma 3's BOS and ordinary tokens, or any of a tiny Llama's vocabulary."""
    rng = np.random.default_rng(seed)
    if loaded.architecture == "gemma3":
        return [2, *rng.integers(260, 365, size=n - 1).tolist()]
    return rng.integers(0, loaded.vocab_size, size=n).tolist()


def prefills(loaded, lengths: list[int], chunk_tokens: int, logprobs: dict | None = None
             ) -> list:
    """A prefill per length; `logprobs` maps a job's index to its ``prompt_logprobs``."""
    logprobs = logprobs or {}
    return [loaded.start_prefill(prompt(loaded, n, seed), prompt_logprobs=logprobs.get(seed),
                                 plan=plan_chunks(n, loaded.sliding_window,
                                                  chunk_tokens=chunk_tokens))
            for seed, n in enumerate(lengths)]


def run_packed(jobs: list) -> int:
    """Step every job to its end, all the unfinished ones' chunks packed in each step;
    returns how many steps packed two or more."""
    packed = 0
    while not all(p.done for p in jobs):
        live = [p for p in jobs if not p.done]
        Prefill.launch_all(live)
        packed += len(live) > 1
        for p in live:
            p.step()
    return packed


@pytest.mark.parametrize("lengths, chunk", [((80, 37, 16), 16), ((200, 5, 130, 64), 48)])
def test_each_job_of_a_packed_pass_gets_its_logits_alone(tiny, lengths, chunk):
    jobs = prefills(tiny, list(lengths), chunk)
    assert run_packed(jobs) >= 2
    for p, alone in zip(jobs, prefills(tiny, list(lengths), chunk), strict=True):
        # measured up to 1.3e-6 (the packed matmuls' larger M blocks differently)
        assert_contract(p.logits(), alone.run(), bound=1e-5)


def test_the_real_gemma3_packs_exactly(gemma):
    jobs = prefills(gemma, [300, 41, 170], 128)
    assert run_packed(jobs) >= 2
    for p, alone in zip(jobs, prefills(gemma, [300, 41, 170], 128), strict=True):
        # measured 0.0 on a 2-core x86-64 CPU
        assert_contract(p.logits(), alone.run(), bound=1e-5)


@pytest.mark.parametrize("lengths, chunk", [((80, 37, 16), 16), ((200, 5, 130, 64), 48)])
@pytest.mark.parametrize("name", LLAMAS)
def test_the_llama_family_packs_exactly(llamas, name, lengths, chunk):
    loaded = llamas[name]
    jobs = prefills(loaded, list(lengths), chunk)
    assert run_packed(jobs) >= 2
    for p, alone in zip(jobs, prefills(loaded, list(lengths), chunk), strict=True):
        # measured 1.4e-7 to 6.1e-7 on a 2-core x86-64 CPU
        assert_contract(p.logits(), alone.run(), bound=PACKED_BOUND)


@pytest.fixture
def packed_passes(monkeypatch) -> list[list]:
    """Each packed pass's ``logprobs`` argument (`model.chunk.launch_packed`), in order."""
    calls, launch = [], model.prefill.launch_packed

    def spy(model_, caches, chunks, logprobs=None, writes=None):
        calls.append(list(logprobs))
        return launch(model_, caches, chunks, logprobs, writes)

    monkeypatch.setattr(model.prefill, "launch_packed", spy)
    return calls


@pytest.mark.parametrize("name", ["gemma3-tiny", "qwen3-tiny", "window"])
def test_a_job_with_prompt_logprobs_packs_and_gets_its_logprobs_alone(
        request, packed_passes, name):
    loaded = (request.getfixturevalue("tiny") if name == "gemma3-tiny"
              else request.getfixturevalue("llamas")[name])
    lengths, k = [40, 70, 23], 5
    jobs = prefills(loaded, lengths, 16, logprobs={0: k})
    run_packed(jobs)
    # each of its chunks (16, 16, 8) went in a packed pass, its last (whose last position
    # has no target: its entry comes from the final logits) included
    assert sum(lp[0] is not None and len(lp) > 1 for lp in packed_passes) == 3
    alone = prefills(loaded, lengths, 16, logprobs={0: k})
    logits = [p.run() for p in alone]
    for p, ref in zip(jobs, logits, strict=True):
        # measured 2.0e-7 to 7.8e-7 on a 2-core x86-64 CPU
        assert_contract(p.logits(), ref, bound=PACKED_BOUND)
    got, ref = jobs[0].logprobs, alone[0].logprobs
    scale = float(np.abs(logits[0]).max())
    assert_top_ids_have_margin(ref, PACKED_BOUND * scale)
    np.testing.assert_array_equal(got.top_ids, ref.top_ids)
    # measured 4.7e-7 to 8.9e-7 x max|logit| (qwen3-tiny: 2.3e-5 with logits up to 39) on a
    # 2-core x86-64 CPU; one job alone in chunks of 16 and in one pass differs as much
    for values, expected in ((got.token_logprob, ref.token_logprob),
                             (got.top_logprobs, ref.top_logprobs)):
        np.testing.assert_allclose(values, expected, rtol=0, atol=PACKED_BOUND * scale)


def assert_top_ids_have_margin(logprobs, tolerance: float) -> None:
    """No two of a position's top K logprobs are closer than twice `tolerance`, so their
    order is meaningful to compare (entry 0 has none)."""
    gaps = -np.diff(logprobs.top_logprobs[1:], axis=1)
    assert gaps.min() > 2 * tolerance, f"near-tie: {gaps.min():.3g}"
