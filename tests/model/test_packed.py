"""Several jobs' chunks in one packed forward pass (`Prefill.launch_all`, Gemma 3's
`Model.packed`) give each job the logits it gets alone (tests/exactness.py)."""

from __future__ import annotations

import numpy as np
import pytest

from model.planner import plan_chunks
from model.prefill import Prefill
from tests.exactness import assert_contract


def prompt(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [2, *rng.integers(260, 365, size=n - 1).tolist()]


def prefills(loaded, lengths: list[int], chunk_tokens: int) -> list:
    return [loaded.start_prefill(prompt(n, seed),
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
