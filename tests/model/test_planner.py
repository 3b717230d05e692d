"""Chunk planning: hf2q's unit-test values (github.com/robertelee78/hf2q, its serving adapter
and prefill verifier), then `plan_chunks` on top of them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from model.planner import (
    DEFAULT_CHUNK_TOKENS,
    MIN_MATRIX_APPEND_TOKENS,
    RECOVERY_TAIL_TOKENS,
    ChunkPlan,
    balance_fresh_three_chunk_prefill,
    matrix_prefill_chunk_len,
    plan_chunks,
    recovery_position,
)

GEMMA_WINDOW = 512
DEEPSEEK_WINDOW = 128


def test_constants_match_hf2q():
    assert DEFAULT_CHUNK_TOKENS == 2048
    assert MIN_MATRIX_APPEND_TOKENS == 33
    assert RECOVERY_TAIL_TOKENS == 8


# hf2q prefill verifier: long_prompts_continue_matrix_prefill_after_the_first_chunk
def test_long_prompts_continue_matrix_prefill_after_the_first_chunk():
    assert matrix_prefill_chunk_len(0, 6_000, 128, 16) == 2_048
    assert matrix_prefill_chunk_len(2_048, 3_952, 128, 16) == 2_048
    assert matrix_prefill_chunk_len(0, 6_000, 128, 32) == 4_096


# hf2q prefill verifier: only_small_cached_suffixes_use_incremental_replay
def test_only_small_cached_suffixes_use_incremental_replay():
    assert matrix_prefill_chunk_len(1_024, MIN_MATRIX_APPEND_TOKENS - 1, 128, 16) == 0
    assert (
        matrix_prefill_chunk_len(1_024, MIN_MATRIX_APPEND_TOKENS, 128, 16)
        == MIN_MATRIX_APPEND_TOKENS
    )


def test_matrix_chunk_is_capped_by_what_remains():
    assert matrix_prefill_chunk_len(0, 100, 128, 16) == 100
    # a fresh prompt shorter than MIN_MATRIX_APPEND_TOKENS still runs as a matrix chunk
    assert matrix_prefill_chunk_len(0, 5, 128, 16) == 5
    assert matrix_prefill_chunk_len(0, 0, 128, 16) == 0


# hf2q serving adapter: fresh_three_chunk_prefill_balances_only_the_underfilled_band
def test_fresh_three_chunk_prefill_balances_only_the_underfilled_band():
    assert balance_fresh_three_chunk_prefill(0, 4_987, 128, 16) == 13
    assert balance_fresh_three_chunk_prefill(0, 4_096, 128, 16) == 16
    assert balance_fresh_three_chunk_prefill(0, 6_144, 128, 16) == 16
    assert balance_fresh_three_chunk_prefill(0, 119_821, 128, 16) == 16
    assert balance_fresh_three_chunk_prefill(1, 4_987, 128, 16) == 16


def test_balance_band_edges_for_gemma_windows():
    # 4 windows of 512 = 2048; the band is (4096, 6144) exclusive
    assert balance_fresh_three_chunk_prefill(0, 4_097, 512, 4) == 3  # ceil(1366 / 512)
    assert balance_fresh_three_chunk_prefill(0, 4_608, 512, 4) == 3  # 1536 / 512 exactly
    assert balance_fresh_three_chunk_prefill(0, 4_609, 512, 4) == 4
    assert balance_fresh_three_chunk_prefill(0, 6_143, 512, 4) == 4


def test_recovery_position_is_n_minus_8_clamped_at_zero():
    assert recovery_position(1000) == 992
    assert recovery_position(9) == 1
    assert recovery_position(8) == 0
    assert recovery_position(3) == 0
    assert recovery_position(0) == 0


@pytest.mark.parametrize(
    ("n", "window", "expected"),
    [
        # DeepSeek-V4 windows: 6000 is in the band, but ceil(ceil(6000/3)/128) = 16 windows
        (6_000, DEEPSEEK_WINDOW, (2_048, 2_048, 1_904)),
        (4_987, DEEPSEEK_WINDOW, (1_664, 1_664, 1_659)),  # 13 windows, as in hf2q
        (3_000, DEEPSEEK_WINDOW, (2_048, 952)),
        (4_096, DEEPSEEK_WINDOW, (2_048, 2_048)),
        (6_144, DEEPSEEK_WINDOW, (2_048, 2_048, 2_048)),
        # Gemma 3 windows: 5000 is in the band, but ceil(1667/512) = 4 windows = the default
        (5_000, GEMMA_WINDOW, (2_048, 2_048, 904)),
        (4_500, GEMMA_WINDOW, (1_536, 1_536, 1_428)),
        (4_097, GEMMA_WINDOW, (1_536, 1_536, 1_025)),
        (1_100, GEMMA_WINDOW, (1_100,)),
        (2_048, GEMMA_WINDOW, (2_048,)),
        (2_049, GEMMA_WINDOW, (2_048, 1)),
        (300, GEMMA_WINDOW, (300,)),  # shorter than one window: one chunk
        (1, GEMMA_WINDOW, (1,)),
    ],
)
def test_default_plan(n, window, expected):
    plan = plan_chunks(n, window)
    assert plan.chunk_sizes == expected
    assert sum(plan.chunk_sizes) == n
    assert plan.n_tokens == n
    assert plan.boundaries[-1] == n
    assert plan.recovery_position == recovery_position(n)


@pytest.mark.parametrize("n", [1, 7, 511, 512, 513, 2_047, 4_097, 6_143, 6_145, 119_821])
@pytest.mark.parametrize("window", [DEEPSEEK_WINDOW, GEMMA_WINDOW])
def test_default_plan_sums_to_n_and_only_the_last_chunk_is_short(n, window):
    sizes = plan_chunks(n, window).chunk_sizes
    assert sum(sizes) == n
    assert all(s >= 1 for s in sizes)
    assert len(set(sizes[:-1])) <= 1  # all equal but the last
    assert all(s % window == 0 and s <= DEFAULT_CHUNK_TOKENS for s in sizes[:-1])
    assert sizes[-1] <= max(sizes)


@pytest.mark.parametrize(
    ("n", "chunk_tokens", "expected"),
    [
        (20, 7, (7, 7, 6)),
        (21, 7, (7, 7, 7)),
        (4_500, 2_048, (2_048, 2_048, 404)),  # exact size: no balancing in the band
        (5_000, 513, (513,) * 9 + (383,)),
        (1_000, 1_000, (1_000,)),  # N == n: one pass
        (1_000, 5_000, (1_000,)),  # N > n: one pass
        (5, 1, (1, 1, 1, 1, 1)),
    ],
)
def test_explicit_chunk_tokens(n, chunk_tokens, expected):
    plan = plan_chunks(n, GEMMA_WINDOW, chunk_tokens=chunk_tokens)
    assert plan.chunk_sizes == expected
    assert sum(plan.chunk_sizes) == n


def test_explicit_chunk_tokens_is_not_window_aligned_or_balanced():
    sizes = plan_chunks(4_987, DEEPSEEK_WINDOW, chunk_tokens=2_048).chunk_sizes
    assert sizes == (2_048, 2_048, 891)  # the default would balance to 1,664 x 3


def test_anchor_adds_a_boundary_at_recovery_position():
    plan = plan_chunks(1_000, GEMMA_WINDOW, anchor=True)
    assert plan.chunk_sizes == (992, 8)
    assert 992 in plan.boundaries
    assert plan_chunks(1_000, GEMMA_WINDOW).chunk_sizes == (1_000,)  # no session, no anchor


def test_anchor_within_explicit_chunks():
    plan = plan_chunks(30, GEMMA_WINDOW, chunk_tokens=7, anchor=True)
    assert plan.recovery_position == 22
    assert plan.boundaries == (7, 14, 21, 22, 28, 30)
    assert sum(plan.chunk_sizes) == 30
    # already a boundary: nothing added
    plan = plan_chunks(29, GEMMA_WINDOW, chunk_tokens=7, anchor=True)
    assert plan.boundaries == (7, 14, 21, 28, 29)


def test_anchor_on_a_default_plan_longer_than_one_chunk():
    plan = plan_chunks(6_000, DEEPSEEK_WINDOW, anchor=True)
    assert plan.boundaries == (2_048, 4_096, 5_992, 6_000)


@pytest.mark.parametrize("n", [1, 5, 8])
def test_anchor_at_zero_adds_nothing(n):
    plan = plan_chunks(n, GEMMA_WINDOW, anchor=True)
    assert plan.recovery_position == 0
    assert plan.chunk_sizes == (n,)


def test_next_chunk_walks_the_boundaries():
    plan = plan_chunks(20, GEMMA_WINDOW, chunk_tokens=7)
    assert plan.next_chunk(0) == (0, 7)
    assert plan.next_chunk(7) == (7, 14)
    assert plan.next_chunk(14) == (14, 20)


@pytest.mark.parametrize("cursor", [1, 6, 8, 20, 21, -7])
def test_next_chunk_raises_off_a_pending_boundary(cursor):
    plan = plan_chunks(20, GEMMA_WINDOW, chunk_tokens=7)
    with pytest.raises(ValueError):
        plan.next_chunk(cursor)


@given(start=st.integers(0, 50), sizes=st.lists(st.integers(1, 9), min_size=1, max_size=40),
       probe=st.integers(-5, 500))
def test_next_chunk_maps_each_pending_boundary_to_the_next(start, sizes, probe):
    """Every chunk's start gives that chunk; any other cursor (inside a chunk, the end,
    outside the plan) raises."""
    ends, total = [], start
    for size in sizes:
        total += size
        ends.append(total)
    plan = ChunkPlan.from_boundaries(total, ends, start=start)
    starts = [start, *ends[:-1]]
    for first, end in zip(starts, ends, strict=True):
        assert plan.next_chunk(first) == (first, end)
    if probe not in starts:
        with pytest.raises(ValueError):
            plan.next_chunk(probe)


@pytest.mark.parametrize("n", [0, -1])
def test_invalid_token_count_raises(n):
    with pytest.raises(ValueError):
        plan_chunks(n, GEMMA_WINDOW)


@pytest.mark.parametrize("chunk_tokens", [0, -3])
def test_invalid_chunk_tokens_raises(chunk_tokens):
    with pytest.raises(ValueError):
        plan_chunks(100, GEMMA_WINDOW, chunk_tokens=chunk_tokens)


@pytest.mark.parametrize(("n", "size", "cursor"), [(100, 16, 32), (100, 16, 5), (37, 5, 36),
                                                  (6_000, None, 2_048), (10, 100, 3)])
def test_a_plan_from_a_cursor_is_the_rest_of_the_prompt(n, size, cursor):
    plan = plan_chunks(n, DEEPSEEK_WINDOW, chunk_tokens=size, cursor=cursor)
    assert plan.start == cursor and plan.boundaries[-1] == n
    assert sum(plan.chunk_sizes) == n - cursor
    step = size or DEFAULT_CHUNK_TOKENS
    assert plan.boundaries == tuple(min(n, e) for e in range(cursor + step, n + step, step))
    assert plan.next_chunk(cursor) == (cursor, plan.boundaries[0])


def test_a_plan_from_cursor_0_is_the_cold_plan():
    for n, size in ((6_000, None), (4_987, None), (100, 16)):
        assert plan_chunks(n, DEEPSEEK_WINDOW, chunk_tokens=size, cursor=0) == plan_chunks(
            n, DEEPSEEK_WINDOW, chunk_tokens=size)


def test_the_anchor_counts_only_after_the_cursor():
    assert plan_chunks(100, 16, chunk_tokens=64, anchor=True, cursor=10).boundaries == (
        74, 92, 100)
    assert plan_chunks(100, 16, chunk_tokens=64, anchor=True, cursor=95).boundaries == (100,)


@pytest.mark.parametrize("cursor", [-1, 100, 101])
def test_a_cursor_outside_the_prompt_is_refused(cursor):
    with pytest.raises(ValueError):
        plan_chunks(100, 16, cursor=cursor)


def test_a_plan_rebuilt_from_its_boundaries_is_the_same_plan():
    for plan in (plan_chunks(100, 16, chunk_tokens=16), plan_chunks(4_987, DEEPSEEK_WINDOW),
                 plan_chunks(100, 16, chunk_tokens=30, cursor=40)):
        assert ChunkPlan.from_boundaries(plan.n_tokens, plan.boundaries,
                                         start=plan.start) == plan


@pytest.mark.parametrize("boundaries", [[], [16, 8, 30], [16, 32], [0, 30], [16, 16, 30],
                                        [31]])
def test_boundaries_must_increase_to_the_prompt_length(boundaries):
    with pytest.raises(ValueError):
        ChunkPlan.from_boundaries(30, boundaries)
