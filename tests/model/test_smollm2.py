"""SmolLM2-135M-Instruct (the real Q4_1 GGUF, `smollm2-135m`, float32 on CPU) against
llama.cpp's final logits for the same ids, its chunked prefill against one pass, and packed
jobs against each alone.

The reference (tests/data/smollm2-135m-llamacpp.json) was made by llama-cpp-python 0.3.36
from the same file; llama.cpp multiplies with 8-bit quantized activations, so its logits
differ from a float32 prefill by its own rounding (see ../shared/reference/README.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from model.planner import DEFAULT_CHUNK_TOKENS, plan_chunks
from tests.exactness import assert_contract
from tests.model.test_packed import run_packed

DATA = Path(__file__).parents[1] / "data"
CASES = json.loads((DATA / "smollm2-135m-llamacpp.json").read_text())["cases"]
# Measured over the six cases: top-5 overlap 4-5 of 5, max |diff| on llama.cpp's top-10
# 0.135-0.435 (0.12-0.32 after removing a constant shift).
MIN_TOP5_OVERLAP = 4
MAX_TOP10_DIFF = 0.6
# Chunked vs one pass, 600 tokens in chunks of 7, 64, 300, float32: measured 1.1e-6 to
# 1.3e-6 x max|logit|; packed vs alone 8.0e-7 to 1.2e-6 (the contract allows 1e-3).
CHUNKED_RTOL = 5e-6


@pytest.fixture(scope="module")
def smollm2():
    from model.registry import load_model

    return load_model("smollm2-135m")


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_final_logits_match_llama_cpp(smollm2, case):
    ids = case["tokens"]
    chunk = len(ids) if len(ids) <= DEFAULT_CHUNK_TOKENS else None  # default plan past it
    logits = smollm2.start_prefill(ids, chunk_tokens=chunk).run()
    assert logits.shape == (smollm2.vocab_size,) == (49_152,)
    ref_ids = np.array(case["top10_ids"])
    ref_logits = np.array(case["top10_logits"], dtype=np.float32)
    overlap = len(set(np.argsort(-logits)[:5].tolist()) & set(ref_ids[:5].tolist()))
    gap = float(np.abs(logits[ref_ids] - ref_logits).max())
    print(f"smollm2 vs llama.cpp, {len(ids)} tokens: top-5 overlap {overlap}, "
          f"max |diff| on llama top-10 {gap:.3f}")
    assert int(logits.argmax()) == int(ref_ids[0])
    assert overlap >= MIN_TOP5_OVERLAP
    assert gap <= MAX_TOP10_DIFF


@pytest.fixture(scope="module")
def long_ids() -> list[int]:
    return next(c["tokens"] for c in CASES if len(c["tokens"]) >= 600)[:600]


@pytest.fixture(scope="module")
def one_pass(smollm2, long_ids) -> np.ndarray:
    return smollm2.start_prefill(long_ids, chunk_tokens=len(long_ids)).run()


@pytest.mark.slow
@pytest.mark.parametrize("chunk_tokens", [7, 64, 300])
def test_chunked_prefill_equals_one_pass(smollm2, long_ids, one_pass, chunk_tokens):
    chunked = smollm2.start_prefill(long_ids, chunk_tokens=chunk_tokens).run()
    diff = float(np.abs(chunked - one_pass).max()) / float(np.abs(one_pass).max())
    print(f"smollm2 chunks of {chunk_tokens}: max|diff| / max|logit| {diff:.2e}")
    assert int(chunked.argmax()) == int(one_pass.argmax())
    top2 = np.sort(one_pass)[-2:]
    assert top2[1] - top2[0] > 1e-3 * float(np.abs(one_pass).max())  # the argmax has margin
    assert diff <= CHUNKED_RTOL


@pytest.mark.slow
def test_packed_jobs_get_their_logits_alone(smollm2):
    """Three prompts' chunks packed in one forward pass each step (`Prefill.launch_all`,
    tests/model/test_packed.py) against each prompt alone."""
    prompts = [CASES[i]["tokens"][:n] for i, n in ((-1, 150), (2, 37), (4, 90))]
    plan = {len(ids): plan_chunks(len(ids), 0, chunk_tokens=64) for ids in prompts}
    jobs = [smollm2.start_prefill(ids, plan=plan[len(ids)]) for ids in prompts]
    assert run_packed(jobs) >= 2
    for p, ids in zip(jobs, prompts, strict=True):
        alone = smollm2.start_prefill(ids, plan=plan[len(ids)]).run()
        # measured 8.0e-7 to 1.2e-6 on a 2-core x86-64 CPU
        assert_contract(p.logits(), alone, bound=CHUNKED_RTOL)
