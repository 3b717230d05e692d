"""`bench.gpu_attention`'s host side on the CPU (its kernels run on a CUDA GPU only)."""

from __future__ import annotations

from bench.gpu_attention import PLAN_SHAPES, SweptGrid, earlier_plan, swept_grids
from model.kernels import flash_attention as fa


def test_the_plan_sweep_times_every_grid_the_sm90_plan_and_the_earlier_plan_choose():
    # otherwise its plan-over-earlier and plan-over-fastest records would be left out
    for H, _, L, position, window in PLAN_SHAPES:
        n_keys = (min(position, window - 1) if window else position) + L
        grids = swept_grids(H, L, n_keys, window)
        assert SweptGrid(*fa.plan(1, H, L, n_keys, window, hopper=True)) in grids
        assert SweptGrid(*earlier_plan(H, L, n_keys, window)) in grids
        assert len(set(grids)) == len(grids)


def test_the_earlier_plan_split_a_4b_chunk_to_one_block_per_multiprocessor():
    # 16 query blocks of 128 x 8 heads = 128 blocks: split in 2 to reach 132
    assert earlier_plan(8, 2048, 8192, None) == (16, 2, 8)
    assert tuple(fa.plan(1, 8, 2048, 8192, None, hopper=True)) == (16, 1, 8)


def test_interleaved_timing_gives_each_function_its_own_fastest_round():
    import mlx.core as mx

    from bench.gpu_attention import _interleaved_seconds

    small, large = mx.ones((64, 64)), mx.ones((512, 512))
    seconds = _interleaved_seconds({"small": lambda: small @ small,
                                    "large": lambda: large @ large}, rounds=3, batch=4)
    assert set(seconds) == {"small", "large"}
    assert 0 < seconds["small"] < seconds["large"]
