"""Sessions (`model.session`): the seeds' reuse rules with their unit-test values, then every
reuse path on Gemma 3 270M (real text ids) and deepseek4-tiny (random ids), each turn's
logits equal to a cold prefill of the same prompt."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from model.cache_plan import SERVING_CAPACITY_STEP_TOKENS
from model.planner import ChunkPlan, plan_chunks
from model.session import (
    MAX_CHEAP_INCREMENTAL_SUFFIX_TOKENS,
    MIN_MATRIX_REUSE_PREFIX_TOKENS,
    RECOVERY_TAIL_TOKENS,
    PrefixReuse,
    SlotTaken,
    cache_capacity_for_request,
    common_prefix_len,
    prefer_matrix_prefill,
    select_prefix_reuse,
)
from tests.model.session_harness import Harness
from tests.model.test_gemma3 import report

LIVE, ANCHOR, RESET = "live", "recovery-anchor", "reset"

# Regression bounds on max |diff| / max |logit| (float32 on CPU), ~5x the worst measured
# over this module's scenarios: Gemma 3 270M measures 7.2e-7 to 1.5e-6, deepseek4-tiny
# 2.7e-7 to 5.3e-7 (session turns, cold first turns and exact hits vs a cold one pass).
GEMMA_BOUND = 8e-6
DEEPSEEK_BOUND = 3e-6
# deepseek4-tiny's random ids: seeds 0-38 give some scenario prompt an indexer near-tie
# (a top-3 gap under 1e-5 x max |score|) or an argmax near-tie; 39 gives none.
TEXT_SEED = 39


# --- the seeds' rules (hf2q's #[test]s, same values) ------------------------------------


def test_constants_are_the_seeds():
    assert (RECOVERY_TAIL_TOKENS, MAX_CHEAP_INCREMENTAL_SUFFIX_TOKENS,
            MIN_MATRIX_REUSE_PREFIX_TOKENS) == (8, 32, 128)


def test_growing_transcript_prefers_longest_live_prefix():
    assert select_prefix_reuse([1, 2, 3, 4, 5], [1, 2, 3, 4], 4, [1, 2], 2) == PrefixReuse(LIVE, 4)


def test_reset_diagnostics_measure_the_exact_divergence_point():
    assert common_prefix_len([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([1], [2]) == 0


def test_canonical_reasoning_drop_restores_pre_answer_turn_anchor():
    got = select_prefix_reuse([1, 2, 7, 8], [1, 2, 9, 7], 4, [1, 2], 2)
    assert got == PrefixReuse(ANCHOR, 2)


def test_compaction_or_edit_resets_when_neither_exact_prefix_matches():
    assert select_prefix_reuse([4, 5, 6], [1, 2, 3], 3, [1, 2], 2) == PrefixReuse(RESET)


def test_trivial_prefix_reuse_yields_to_full_matrix_prefill():
    assert prefer_matrix_prefill(306, PrefixReuse(ANCHOR, 1)) == PrefixReuse(RESET)
    assert prefer_matrix_prefill(516, PrefixReuse(LIVE, 16)) == PrefixReuse(RESET)


def test_short_suffix_and_meaningful_prefix_still_reuse_cache():
    assert prefer_matrix_prefill(48, PrefixReuse(LIVE, 37)) == PrefixReuse(LIVE, 37)
    assert prefer_matrix_prefill(180, PrefixReuse(ANCHOR, 140)) == PrefixReuse(ANCHOR, 140)


def test_advertised_context_does_not_eagerly_allocate_unused_kv():
    assert cache_capacity_for_request(524_288, 131_072, 98_000, 8_192) == 131_072
    assert cache_capacity_for_request(524_288, 131_072, 131_000, 8_192) == 262_144
    assert cache_capacity_for_request(524_288, 262_144, 510_000, 32_768) == 524_288
    assert SERVING_CAPACITY_STEP_TOKENS == 131_072


def test_selection_edges():
    # a cache that may not be resumed (poisoned: position -1) offers only its anchor
    assert select_prefix_reuse([1, 2, 3], [1, 2], -1, [1], 1) == PrefixReuse(ANCHOR, 1)
    # the anchor needs a longer prompt; the live prefix takes an exact repeat
    assert select_prefix_reuse([1, 2], [1, 2, 3], 3, [1, 2], 2) == PrefixReuse(RESET)
    assert select_prefix_reuse([1, 2, 3], [1, 2, 3], 3, [1, 2], 2) == PrefixReuse(LIVE, 3)
    # a snapshot not at its tokens' length is not offered
    assert select_prefix_reuse([1, 2, 3], [9], 1, [1, 2], 1) == PrefixReuse(RESET)
    assert prefer_matrix_prefill(160, PrefixReuse(LIVE, 128)) == PrefixReuse(LIVE, 128)
    assert prefer_matrix_prefill(159, PrefixReuse(LIVE, 127)) == PrefixReuse(LIVE, 127)
    assert prefer_matrix_prefill(160, PrefixReuse(LIVE, 127)) == PrefixReuse(RESET)


def test_capacity_steps_are_a_parameter():
    assert cache_capacity_for_request(4096, 320, 340, step=64) == 384
    assert cache_capacity_for_request(4096, 384, 384, step=64) == 384
    assert cache_capacity_for_request(400, 384, 390, step=64) == 400  # capped at the context
    with pytest.raises(ValueError):
        cache_capacity_for_request(4096, 0, 10, step=0)
    with pytest.raises(ValueError):
        PrefixReuse(RESET, 3)
    with pytest.raises(ValueError):
        PrefixReuse("trim", 3)


# --- both architectures -----------------------------------------------------------------


@pytest.fixture(scope="module", params=["gemma3-270m", "deepseek4-tiny"])
def h(request, reference_cases) -> Harness:
    if request.param == "gemma3-270m":
        loaded = request.getfixturevalue("gemma")
        ids = next(c["tokens"] for c in reference_cases if len(c["tokens"]) >= 6000)
        harness = Harness(loaded, ids[:3000], ids[3000:], n1=600, chunk=256, step=128,
                          bound=GEMMA_BOUND, default_step=2048)
    else:
        from model.registry import load_model

        loaded = load_model("deepseek4-tiny", dtype=mx.float32)
        rng = np.random.default_rng(TEXT_SEED)
        text, other = (list(map(int, rng.integers(0, loaded.vocab_size, 1000))) for _ in "ab")
        harness = Harness(loaded, text, other, n1=150, chunk=64, step=64,
                          bound=DEEPSEEK_BOUND, check_selections=True)
    yield harness
    report(request, [f"session {request.param} {name}: max|diff| / max|logit| {ratio:.3g}"
                     for name, ratio in harness.diffs.items()])


def test_follow_up_reuses_the_live_prefix(h):
    ids1, slot = h.first_turn()
    ids2 = h.text[: h.n1 + 100]
    assert slot.reusable_prefix_len(ids2) == h.n1
    prefill, same = h.turn(slot, ids2)
    assert same is slot and (prefill.reuse, prefill.cached_tokens) == (LIVE, h.n1)
    assert prefill.plan.start == h.n1 and prefill.plan.recovery_position in prefill.plan.boundaries
    prefill.run()
    h.check("live follow-up", prefill, ids2)
    assert slot.committed == ids2 and slot.anchor_tokens == ids2[:-8]


def test_rewritten_last_tokens_restore_the_anchor(h):
    ids1, slot = h.first_turn()
    assert h.n1 - 8 > h.window  # the ring wrapped past the anchor: only the snapshot helps
    ids2 = ids1[:-3] + h.other[:60]
    assert ids2[h.n1 - 3] != ids1[h.n1 - 3]
    assert slot.reusable_prefix_len(ids2) == h.n1 - 8
    prefill, _ = h.turn(slot, ids2)
    assert (prefill.reuse, prefill.cached_tokens) == (ANCHOR, h.n1 - 8)
    prefill.run()
    h.check("anchor restored", prefill, ids2)


def test_an_edited_earlier_turn_resets(h):
    ids1, slot = h.first_turn()
    at = h.n1 - 20  # before the anchor, after the 128 tokens prefer_matrix_prefill wants
    ids2 = h.text[:at] + [h.other[0]] + h.text[at + 1 : h.n1 + 50]
    assert ids2[at] != ids1[at] and at >= MIN_MATRIX_REUSE_PREFIX_TOKENS  # select resets
    assert slot.reusable_prefix_len(ids2) == 0
    prefill, _ = h.turn(slot, ids2)
    assert (prefill.reuse, prefill.cached_tokens, prefill.plan.start) == (RESET, 0, 0)
    prefill.run()
    h.check("reset", prefill, ids2)
    assert slot.committed == ids2 and slot.anchor_tokens == ids2[:-8]


def test_an_exact_repeat_runs_no_forward_pass(h):
    ids1, slot = h.first_turn()
    prefill, _ = h.turn(slot, list(ids1))
    assert (prefill.reuse, prefill.cached_tokens) == ("exact", h.n1)
    assert prefill.done and prefill.chunks_done == 0
    with pytest.raises(ValueError):
        prefill.step()
    h.check("exact", prefill, ids1)


def test_a_strict_prefix_of_the_committed_tokens_never_trims(h):
    ids1, slot = h.first_turn()
    shorter = ids1[:-4]  # longer than the anchor: restore it, run 4 tokens
    prefill, _ = h.turn(slot, shorter)
    assert (prefill.reuse, prefill.cached_tokens) == (ANCHOR, h.n1 - 8)
    prefill.run()
    h.check("strict prefix, anchor", prefill, shorter)
    shortest = ids1[:-60]  # shorter than the anchor too: reset
    prefill, _ = h.turn(slot, shortest)
    assert (prefill.reuse, prefill.cached_tokens) == (RESET, 0)
    prefill.run()
    h.check("strict prefix, reset", prefill, shortest)


def canceled_second_turn(h: Harness):
    """First turn, then a live follow-up stopped once the ring no longer holds the anchor."""
    ids1, slot = h.first_turn()
    ids2 = h.text[: h.n1 + 4 * h.chunk]
    prefill, _ = h.turn(slot, ids2)
    while prefill.cursor - h.window <= h.n1 - 8:
        prefill.step()
    assert prefill.cursor < prefill.plan.recovery_position  # no new anchor yet
    assert slot.committed == ids2[: prefill.cursor] and slot.cache.position == prefill.cursor
    return ids1, slot, prefill


def test_canceled_mid_prefill_then_the_next_turn_equals_cold(h):
    _, slot, canceled = canceled_second_turn(h)
    cursor = canceled.cursor
    ids3 = h.text[: cursor + 40]
    prefill, _ = h.turn(slot, ids3)
    assert (prefill.reuse, prefill.cached_tokens) == (LIVE, cursor)
    with pytest.raises(SlotTaken):
        canceled.step()
    prefill.run()
    h.check("after a cancel, live", prefill, ids3)


def test_an_anchor_older_than_the_rings_oldest_row_is_restored(h):
    ids1, slot, canceled = canceled_second_turn(h)
    assert slot.cache.position - h.window > len(slot.anchor_tokens)
    ids3 = ids1[:-3] + h.other[:50]
    prefill, _ = h.turn(slot, ids3)
    assert (prefill.reuse, prefill.cached_tokens) == (ANCHOR, h.n1 - 8)
    prefill.run()
    h.check("anchor before the ring", prefill, ids3)


def test_growth_mid_session_keeps_reuse_and_exactness(h):
    _, slot = h.first_turn(capacity_step=h.step)
    cap1 = slot.cache.capacity
    assert cap1 == -(-h.n1 // h.step) * h.step
    ids2 = h.text[: cap1 + 10]
    prefill, _ = h.turn(slot, ids2, capacity_step=h.step)
    assert (prefill.reuse, prefill.cached_tokens) == ("grow-live", h.n1)
    assert slot.cache.capacity == cap1 + h.step
    prefill.run()
    h.check("grow-live", prefill, ids2)
    ids3 = ids2[:-3] + h.other[: slot.cache.capacity - len(ids2) + 20]
    prefill, _ = h.turn(slot, ids3, capacity_step=h.step)
    assert (prefill.reuse, prefill.cached_tokens) == ("grow-recovery-anchor", len(ids2) - 8)
    prefill.run()
    h.check("grow-recovery-anchor", prefill, ids3)
    ids4 = h.other[: slot.cache.capacity + 10]
    prefill, _ = h.turn(slot, ids4, capacity_step=h.step)
    assert (prefill.reuse, prefill.cached_tokens) == ("grow-reset", 0)
    prefill.run()
    h.check("grow-reset", prefill, ids4)


def test_two_interleaved_sessions_never_see_each_others_tokens(h):
    a1, b1 = h.text[: h.n1], h.text[:1] + h.other[: h.n1 - 1]
    pa, slot_a = h.turn(None, a1)
    pb, slot_b = h.turn(None, b1)
    for turn in range(2):
        while not (pa.done and pb.done):
            for p in (pa, pb):
                if not p.done:
                    p.step()
        h.check(f"interleaved A{turn + 1}", pa, a1)
        h.check(f"interleaved B{turn + 1}", pb, b1)
        a1, b1 = a1 + h.text[h.n1 : h.n1 + 60], b1 + h.other[h.n1 : h.n1 + 60]
        pa, _ = h.turn(slot_a, a1)
        pb, _ = h.turn(slot_b, b1)
        assert (pa.reuse, pb.reuse) == (LIVE, LIVE)
    assert slot_a.cache is not slot_b.cache


def test_a_failed_chunk_offers_no_live_reuse(h, monkeypatch):
    ids1, slot = h.first_turn()
    ids2 = h.text[: h.n1 + 3 * h.chunk]
    prefill, _ = h.turn(slot, ids2)
    prefill.step()
    model_type, original = type(h.loaded.model), type(h.loaded.model).__call__

    def boom(self, inputs, cache):  # the forward wrote its rows, then failed
        mx.eval(original(self, inputs, cache), cache.arrays())
        raise RuntimeError("injected")

    monkeypatch.setattr(model_type, "__call__", boom)
    with pytest.raises(RuntimeError, match="injected"):
        prefill.step()
    monkeypatch.undo()
    assert slot.cache.is_poisoned and slot.committed == ids2[: h.n1 + h.chunk]
    assert slot.reusable_prefix_len(ids2) == h.n1 - 8
    again, _ = h.turn(slot, ids2)
    assert (again.reuse, again.cached_tokens) == (ANCHOR, h.n1 - 8)
    again.run()
    h.check("after a failed chunk", again, ids2)


def test_a_recorded_plan_is_continued_from_the_reused_cursor(h):
    ids1, slot = h.first_turn()
    ids2 = h.text[: h.n1 + 100]
    recorded = ChunkPlan.from_boundaries(len(ids2), [h.n1 - 100, h.n1 + 50, len(ids2)])
    prefill, _ = h.turn(slot, ids2, plan=recorded)
    assert prefill.plan.start == h.n1 and prefill.plan.boundaries == (h.n1 + 50, len(ids2))
    prefill.run()
    assert slot.anchor_tokens == ids1[:-8]  # that plan has no chunk end at the anchor
    h.check("recorded plan", prefill, ids2)
    later = plan_chunks(len(ids2) + 20, h.window, cursor=len(ids2) + 10)
    prefill, _ = h.turn(slot, h.text[: len(ids2) + 20], plan=later)  # starts past the cursor
    assert prefill.plan.start == len(ids2) and prefill.plan.recovery_position == len(ids2) + 12
    assert len(ids2) + 12 in prefill.plan.boundaries
    prefill.run()
    h.check("fresh plan", prefill, h.text[: len(ids2) + 20])


def test_slot_bytes_count_the_cache_the_anchor_and_the_hidden_state(h):
    _, slot = h.first_turn()
    assert slot.anchor.nbytes == slot.cache.plan().fixed_bytes  # every ring (and state) copied
    assert slot.nbytes == slot.cache.nbytes + slot.anchor.nbytes + 2 * slot.hidden.nbytes
    slot.reset()
    assert slot.is_empty and slot.cache.position == 0 and slot.nbytes == slot.cache.nbytes


def test_resetting_a_failed_session_prefill_replans_from_zero(h, monkeypatch):
    _, slot = h.first_turn()
    ids2 = h.text[: h.n1 + 2 * h.chunk]
    prefill, _ = h.turn(slot, ids2)
    monkeypatch.setattr(type(h.loaded.model), "__call__", lambda self, inputs, cache: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        prefill.step()
    monkeypatch.undo()
    prefill.reset()
    assert (prefill.cursor, prefill.plan.start, prefill.cached_tokens) == (0, 0, 0)
    assert prefill.reuse == RESET and slot.is_empty and not slot.cache.is_poisoned
    assert prefill.plan.recovery_position in prefill.plan.boundaries
    prefill.run()
    h.check("reset after a failed chunk", prefill, ids2)
    assert slot.committed == ids2 and slot.anchor_tokens == ids2[:-8]


def test_a_cold_prefill_reports_no_reuse(h):
    prefill = h.loaded.start_prefill(h.text[:20])
    assert (prefill.cached_tokens, prefill.reuse) == (0, "cold")


def saved_and_restored(h: Harness, slot):
    """`slot` through `slot_state`, msgpack and `slot_from_state`: another process's copy."""
    import msgpack

    from model.session_state import slot_from_state, slot_state

    blob = msgpack.packb(slot_state(slot), use_bin_type=True)
    return slot_from_state(h.loaded.model, msgpack.unpackb(blob, raw=False))


def test_a_restored_slot_continues_live_and_from_its_anchor(h):
    ids1, slot = h.first_turn()
    restored = saved_and_restored(h, slot)
    assert restored.committed == ids1 and restored.anchor_tokens == ids1[:-8]
    live_ids = h.text[: h.n1 + 100]
    prefill, _ = h.turn(restored, live_ids)
    assert (prefill.reuse, prefill.cached_tokens) == (LIVE, h.n1)
    prefill.run()
    h.check("restored slot, live", prefill, live_ids)
    anchor_ids = ids1[:-3] + h.other[:60]
    prefill, _ = h.turn(saved_and_restored(h, slot), anchor_ids)
    assert (prefill.reuse, prefill.cached_tokens) == (ANCHOR, h.n1 - 8)
    prefill.run()
    h.check("restored slot, anchor", prefill, anchor_ids)


def test_a_slot_state_of_another_model_or_mangled_is_refused(h):
    from model.cache import CacheStateError
    from model.session_state import slot_from_state, slot_state

    _, slot = h.first_turn()
    state = slot_state(slot)
    with pytest.raises(CacheStateError):
        slot_from_state(h.loaded.model, {**state, "version": 99})
    with pytest.raises(CacheStateError):
        slot_from_state(h.loaded.model, {**state, "committed": state["committed"][:-1]})
    with pytest.raises(CacheStateError):
        slot_from_state(h.loaded.model, {**state, "anchor_tokens": [0] * 5})
    other = "gemma3-tiny" if h.loaded.architecture != "gemma3" else "deepseek4-tiny"
    from model.registry import load_model

    with pytest.raises(CacheStateError):
        slot_from_state(load_model(other, dtype=mx.float32).model, state)
