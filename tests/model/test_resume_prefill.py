"""`LoadedModel.resume_prefill`: a prefill continued from a complete state at a chunk end
gives bitwise the logits of the uninterrupted chunked prefill, and bad inputs are refused."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
import pytest

from model.cache import CacheStateError
from model.planner import ChunkPlan

N = 120
BOUNDARIES = [5, 37, 64, 100, N]  # unaligned to the 16-token windows and ratio-4/128 groups


@functools.cache
def loaded(name: str):
    from model.registry import load_model

    return load_model(name, dtype=mx.float32)


def ids_for(name: str) -> list[int]:
    rng = np.random.default_rng(11)
    return [int(t) for t in rng.integers(0, loaded(name).vocab_size, N)]


def state_at(name: str, stop: int):
    prefill = loaded(name).start_prefill(
        ids_for(name), plan=ChunkPlan.from_boundaries(N, BOUNDARIES)
    )
    while prefill.cursor < stop:
        prefill.step()
    return prefill.cache.state()


@pytest.mark.parametrize("name", ["gemma3-tiny", "deepseek4-tiny"])
@pytest.mark.parametrize("stop", [37, 100])
def test_resumed_prefill_continues_bitwise(name, stop):
    plan = ChunkPlan.from_boundaries(N, BOUNDARIES)
    reference = loaded(name).start_prefill(ids_for(name), plan=plan).run()
    resumed = loaded(name).resume_prefill(ids_for(name), plan, state_at(name, stop))
    assert resumed.cursor == stop and resumed.chunks_done == 0
    logits = resumed.run()
    assert resumed.chunks_done == len([b for b in BOUNDARIES if b > stop])
    np.testing.assert_array_equal(logits, reference)


def test_resume_refuses_a_position_off_the_plan_or_at_its_end():
    plan = ChunkPlan.from_boundaries(N, BOUNDARIES)
    other = ChunkPlan.from_boundaries(N, [30, N])
    with pytest.raises(ValueError, match="not a chunk end"):
        loaded("gemma3-tiny").resume_prefill(
            ids_for("gemma3-tiny"), other, state_at("gemma3-tiny", 37)
        )
    full = state_at("gemma3-tiny", N)
    with pytest.raises(ValueError, match="not a chunk end"):
        loaded("gemma3-tiny").resume_prefill(ids_for("gemma3-tiny"), plan, full)
    with pytest.raises(ValueError, match="does not fit"):
        loaded("gemma3-tiny").resume_prefill(ids_for("gemma3-tiny")[:-1], plan, full)


def test_resume_refuses_another_dtype_or_architecture():
    plan = ChunkPlan.from_boundaries(N, BOUNDARIES)
    state = state_at("gemma3-tiny", 37)
    state.meta["kv_dtype"] = "bfloat16"
    with pytest.raises(ValueError, match="kv_dtype"):
        loaded("gemma3-tiny").resume_prefill(ids_for("gemma3-tiny"), plan, state)
    ids = [t % loaded("gemma3-tiny").vocab_size for t in ids_for("deepseek4-tiny")]
    with pytest.raises(CacheStateError):
        loaded("gemma3-tiny").resume_prefill(ids, plan, state_at("deepseek4-tiny", 37))
