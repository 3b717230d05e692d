"""What the session tests need of a model: prompts, its cold reference and the exactness check.

One `Harness` per architecture (Gemma 3 270M, real text ids; deepseek4-tiny, random ids), so
every scenario in `tests.model.test_session` runs on both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from model.prefill import Prefill
from model.registry import LoadedModel
from model.session import SessionSlot

# The contract (tests/exactness.py): max |diff| <= 1e-3 x max |logit| and the same argmax.
EXACT_RTOL = 1e-3
# Top-k choices (DeepSeek-V4 indexer rows, MoE experts) of a cold run must clear this gap x
# the largest |score| (~10x float32 noise), or a chunked run could pick another row.
SELECTION_MIN_GAP = 1e-5


@dataclass
class Harness:
    """A model and the shapes of the conversations the scenarios build for it.

    Attributes:
        text, other: long id sequences; turns are slices of `text`, divergent tails come
            from `other` (and a second session's turns).
        n1: the first turn's length: over the window and over 128 + 8 tokens.
        chunk: chunk tokens of the session turns.
        step: capacity step of the growth scenario; `default_step` that of the others
            (large enough that they never grow).
        bound: regression bound on max |diff| / max |logit| (~5x the worst measured).
        diffs: measured ratios by scenario, reported when the module ends.
    """

    loaded: LoadedModel
    text: list[int]
    other: list[int]
    n1: int
    chunk: int
    step: int
    bound: float
    check_selections: bool = False
    default_step: int | None = None
    diffs: dict[str, float] = field(default_factory=dict)
    _cold: dict[tuple[int, ...], np.ndarray] = field(default_factory=dict)
    _first: dict[tuple, SessionSlot] = field(default_factory=dict)

    @property
    def window(self) -> int:
        return self.loaded.sliding_window

    def turn(self, slot: SessionSlot | None, ids: list[int], **kw) -> tuple[Prefill, SessionSlot]:
        kw.setdefault("chunk_tokens", self.chunk)
        kw.setdefault("capacity_step", self.default_step)
        return self.loaded.session_prefill(slot, ids, **kw)

    def cold(self, ids: list[int]) -> np.ndarray:
        """A cold prefill's logits (one pass up to 2,048 tokens), computed once per prompt."""
        key = tuple(ids)
        if key not in self._cold:
            self._cold[key] = self._run_cold(ids)
        return self._cold[key]

    def _run_cold(self, ids: list[int]) -> np.ndarray:
        if not self.check_selections:
            return self.loaded.start_prefill(ids).run()
        recorded, argpartition = [], mx.argpartition

        def spy(a, kth, axis=-1):
            recorded.append((np.array(a), kth))
            return argpartition(a, kth, axis=axis)

        mx.argpartition = spy
        try:
            logits = self.loaded.start_prefill(ids).run()
        finally:
            mx.argpartition = argpartition
        assert recorded, "no top-k selection ran"
        for values, k in recorded:
            assert_selection_margin(values, k)
        return logits

    def check(self, name: str, prefill: Prefill, ids: list[int]) -> None:
        """`prefill`'s logits equal a cold run's (contract and `bound`); record the ratio."""
        assert prefill.done
        got, ref = prefill.logits(), self.cold(ids)
        scale = float(np.abs(ref).max())
        diff = float(np.abs(got - ref).max())
        top2 = np.sort(ref)[-2:]
        assert top2[1] - top2[0] > 2 * EXACT_RTOL * scale, f"{name}: argmax near-tie"
        assert diff <= EXACT_RTOL * scale, f"{name}: max |diff| {diff:.3g} > contract"
        self.diffs[name] = max(self.diffs.get(name, 0.0), diff / scale)
        assert diff <= self.bound * scale, f"{name}: {diff / scale:.3g} x max |logit| > bound"
        assert int(got.argmax()) == int(ref.argmax())

    def first_turn(self, **kw) -> tuple[list[int], SessionSlot]:
        """A session after one finished turn of `n1` tokens, checked against cold (run once
        per `kw`; each call gets its own copy of the slot)."""
        ids = self.text[: self.n1]
        key = tuple(sorted(kw.items()))
        if key not in self._first:
            prefill, slot = self.turn(None, ids, **kw)
            assert (prefill.reuse, prefill.cached_tokens) == ("cold", 0)
            prefill.run()
            self.check("first turn", prefill, ids)
            self._first[key] = slot
        slot = copy_slot(self.loaded, self._first[key])
        assert slot.committed == ids and slot.anchor_tokens == ids[: self.n1 - 8]
        return ids, slot


def copy_slot(loaded: LoadedModel, slot: SessionSlot) -> SessionSlot:
    """An independent slot equal to `slot`: its cache through ``state()`` (exact), the rest
    shared (snapshots and hidden states are never written in place)."""
    cache = loaded.model.cache_from_state(slot.cache.state())
    cache.capacity_step = slot.cache.capacity_step
    return SessionSlot(cache, list(slot.committed), slot.hidden, slot.anchor,
                       list(slot.anchor_tokens), slot.anchor_hidden)


def assert_selection_margin(values: np.ndarray, k: int) -> None:
    """The k-th and (k+1)-th smallest of each row (``-score``) differ by the margin."""
    values = np.sort(values.reshape(-1, values.shape[-1]), axis=-1)
    if values.shape[-1] <= k + 1:
        return
    live = np.isfinite(values[:, k + 1])
    if not live.any():
        return
    gap = (values[live, k + 1] - values[live, k]).min()
    scale = np.abs(values[np.isfinite(values)]).max()
    assert gap > SELECTION_MIN_GAP * scale, f"top-{k + 1} near-tie: {gap:.3g} at {scale:.3g}"
