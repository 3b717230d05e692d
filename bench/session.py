"""A session's follow-up turn against a cold prefill of the same prompt, side by side.

One session slot (`model.session`) takes an 8K-token history, then follow-up turns that
each add 64 new tokens; every follow-up is timed against a cold prefill of exactly its
prompt, the two run back to back, alternating which goes first. A follow-up reuses the live
prefix, so it computes its 64 new tokens (and re-anchors 8 tokens before its end).
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from model.registry import LoadedModel

from .common import Recorder, log, prompt_ids


def session_turn_over_cold(rec: Recorder, loaded: LoadedModel, history: int = 8192,
                           new: int = 64, turns: int = 2, ids: list[int] | None = None) -> None:
    """Record ``session_turn_over_cold``: a follow-up turn's seconds over a cold prefill's of
    the same prompt (each follow-up against its own prompt's cold run; the best pair's
    ratio, every pair's in ``ratios``), after checking every follow-up's logits equal the
    cold run's (tests/exactness.py).

    Args:
        ids: the conversation's token ids, at least ``history + new * turns`` of them
            (default: real Gemma 3 ids, `prompt_ids`).
    Raises:
        AssertionError: a follow-up's logits differ from the cold run's.
    """
    ids = (ids or prompt_ids(history + new * turns))[:history + new * turns]
    log(f"session follow-up: {history}-token history + {new} new tokens, {turns} turns")
    t0 = time.perf_counter()
    first, slot = loaded.session_prefill(None, ids[:history])
    first.run()
    history_s = time.perf_counter() - t0
    pairs = []
    for turn in range(1, turns + 1):
        prompt = ids[:history + new * turn]
        if turn % 2:  # alternate which of the pair runs first
            cold_s, cold_logits = _cold(loaded, prompt)
            turn_s, turn_logits, prefill = _follow_up(loaded, slot, prompt)
        else:
            turn_s, turn_logits, prefill = _follow_up(loaded, slot, prompt)
            cold_s, cold_logits = _cold(loaded, prompt)
        mx.clear_cache()
        diff = float(np.abs(turn_logits - cold_logits).max())
        if diff > 1e-3 * float(np.abs(cold_logits).max()) or (
                turn_logits.argmax() != cold_logits.argmax()):
            raise AssertionError(f"follow-up turn {turn} differs from cold: max |diff| {diff}")
        pairs.append((turn_s / cold_s, turn_s, cold_s, prefill.reuse, prefill.cached_tokens,
                      diff))
    ratio, turn_s, cold_s, reuse, cached, diff = min(pairs)
    rec("session_turn_over_cold", ratio, "ratio", ceiling=0.1, history_tokens=history,
        new_tokens=new, turns=turns, follow_up_s=round(turn_s, 4), cold_s=round(cold_s, 3),
        history_s=round(history_s, 3), reuse=reuse, cached_tokens=cached,
        max_abs_diff=round(diff, 6), ratios=[round(p[0], 5) for p in pairs],
        how="one slot: an 8K history turn, then follow-ups of +64 tokens, each timed "
            "against a cold prefill of its prompt, back to back; the best pair")


def _follow_up(loaded: LoadedModel, slot, prompt: list[int]):
    t = time.perf_counter()
    prefill, _ = loaded.session_prefill(slot, prompt)
    logits = prefill.run()
    return time.perf_counter() - t, logits, prefill


def _cold(loaded: LoadedModel, prompt: list[int]) -> tuple[float, np.ndarray]:
    t = time.perf_counter()
    logits = loaded.start_prefill(prompt).run()
    return time.perf_counter() - t, logits
