"""`bench.gpu_attention`'s host side on the CPU (its kernels run on a CUDA GPU only)."""

from __future__ import annotations

from bench.gpu_attention import PLAN_SHAPES, swept_grids
from model.kernels import flash_attention as fa


def test_the_plan_sweep_times_every_grid_the_sm90_plan_and_the_earlier_plan_choose():
    # otherwise its plan-over-earlier and plan-over-fastest records would be left out
    for H, _, L, position, window in PLAN_SHAPES:
        n_keys = (min(position, window - 1) if window else position) + L
        visible = min(n_keys, window + 128) if window else n_keys
        grids = swept_grids(L, visible)
        assert tuple(fa.plan(1, H, L, n_keys, window, hopper=True)) in grids
        assert tuple(fa.grid_plan(1, H, L, n_keys, window, fa.SM90_BLOCK_N, 8, 132)) in grids
