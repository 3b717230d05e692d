"""Several jobs' chunks in one packed forward pass (`Prefill.launch_all`, the models'
`model.archs._packed.PackedModel.packed`: Gemma 3 and the Llama family) give each job the
logits it gets alone (tests/exactness.py)."""

from __future__ import annotations

import numpy as np
import pytest

from model.gguf.synthetic.llama import TINY_LLAMAS, write_tiny_llama
from model.planner import plan_chunks
from model.prefill import Prefill
from model.registry import load_model
from tests.exactness import assert_contract
from tests.model.test_llama import WINDOW

# the registered tiny Llamas (GQA 4/2 with Llama 3 RoPE, GQA 6/2 with q/k/v biases, q/k
# norms over one KV head) and test_llama's `window` (rings on 3 of 4 layers, MHA, biases)
LLAMAS = [*sorted(TINY_LLAMAS), "window"]
# max |diff| / max |logit| of a packed pass against the job alone, for the tiny Llamas'
# logits: 5x the worst measured (below)
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


def test_a_job_with_prompt_logprobs_is_launched_alone(tiny):
    plain, with_logprobs = prefills(tiny, [40, 40], 16)
    lp = tiny.start_prefill(with_logprobs.token_ids, prompt_logprobs=2,
                            plan=plan_chunks(40, tiny.sliding_window, chunk_tokens=16))
    Prefill.launch_all([plain, lp])
    assert plain.launched and lp.launched
    plain.step(), lp.step()
    while not lp.done:
        lp.step()
    reference = tiny.start_prefill(with_logprobs.token_ids, prompt_logprobs=2,
                                   plan=plan_chunks(40, tiny.sliding_window, chunk_tokens=16))
    reference.run()
    np.testing.assert_array_equal(lp.logprobs.token_logprob, reference.logprobs.token_logprob)
