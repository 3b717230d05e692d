"""Sessions: a conversation's next prompt prefills only what its retained cache lacks.

A `SessionSlot` keeps one conversation's cache on a worker; `session_prefill` reuses it by
the rules of hf2q's DeepSeek-V4 serving adapter (seed ``000_5548d34d07140090``:
``Deepseek4Session``, ``select_prefix_reuse``, ``prefer_matrix_prefill``, ``prefill_suffix``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from .cache_plan import cache_capacity_for_request
from .chunk import PrefillModel
from .planner import RECOVERY_TAIL_TOKENS, ChunkPlan, check_prompt, plan_chunks, recovery_position
from .prefill import Prefill

__all__ = [
    "MAX_CHEAP_INCREMENTAL_SUFFIX_TOKENS", "MIN_MATRIX_REUSE_PREFIX_TOKENS",
    "RECOVERY_TAIL_TOKENS", "REUSE_KINDS", "PrefixReuse", "SessionPrefill", "SessionSlot",
    "SlotTaken",
    "cache_capacity_for_request", "common_prefix_len", "prefer_matrix_prefill",
    "select_prefix_reuse", "session_prefill",
]

# A suffix longer than this after a short prefix is cheaper as one cold matrix pass (hf2q).
MAX_CHEAP_INCREMENTAL_SUFFIX_TOKENS = 32
# ...where "short" means a reusable prefix of fewer tokens than this.
MIN_MATRIX_REUSE_PREFIX_TOKENS = 128

LIVE, RECOVERY_ANCHOR, RESET = "live", "recovery-anchor", "reset"
COLD, EXACT = "cold", "exact"
GROW = "grow-"  # prefixed to live / recovery-anchor / reset when the cache grew first
REUSE_KINDS = (COLD, LIVE, RECOVERY_ANCHOR, RESET, EXACT,
               GROW + LIVE, GROW + RECOVERY_ANCHOR, GROW + RESET)


@dataclass(frozen=True)
class PrefixReuse:
    """A reuse decision: `kind` (``live``, ``recovery-anchor`` or ``reset``) and how many
    prompt tokens it keeps (0 for ``reset``). Source: hf2q's ``PrefixReuse`` enum.

    Raises:
        ValueError: another kind, negative tokens, or tokens with ``reset``.
    """

    kind: str
    tokens: int = 0

    def __post_init__(self) -> None:
        if self.kind not in (LIVE, RECOVERY_ANCHOR, RESET) or self.tokens < 0 or (
            self.kind == RESET and self.tokens
        ):
            raise ValueError(f"not a prefix reuse: {self.kind} of {self.tokens} tokens")


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens `a` and `b` share from the start (hf2q ``common_prefix_len``)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _starts_with(prompt: Sequence[int], prefix: Sequence[int]) -> bool:
    return len(prompt) >= len(prefix) and list(prompt[: len(prefix)]) == list(prefix)


def select_prefix_reuse(
    prompt: Sequence[int],
    live: Sequence[int],
    live_position: int,
    anchor: Sequence[int],
    anchor_position: int,
) -> PrefixReuse:
    """The longest safe reuse of a retained cache for `prompt` (hf2q ``select_prefix_reuse``).

    Args:
        prompt: the new prompt's token ids.
        live: the ids committed into the cache; `live_position` the cache's position (pass
            -1 when the cache may not be resumed, e.g. poisoned).
        anchor: the turn anchor's ids; `anchor_position` its snapshot's position (0: none).
    Returns:
        ``live(len(live))`` when the cache holds exactly `live` and `prompt` starts with it
        (an exact repeat included); else ``recovery-anchor(len(anchor))`` when the snapshot
        holds exactly `anchor` and `prompt` is longer and starts with it; else ``reset``.
    """
    if live and live_position == len(live) and _starts_with(prompt, live):
        return PrefixReuse(LIVE, len(live))
    if anchor and anchor_position == len(anchor) and len(prompt) > len(anchor) and _starts_with(
        prompt, anchor
    ):
        return PrefixReuse(RECOVERY_ANCHOR, len(anchor))
    return PrefixReuse(RESET)


def prefer_matrix_prefill(prompt_len: int, reuse: PrefixReuse) -> PrefixReuse:
    """``reset`` instead of `reuse` when it keeps fewer than 128 tokens of a prompt whose
    suffix is over 32 tokens, else `reuse` (hf2q ``prefer_matrix_prefill``)."""
    if reuse.kind == RESET:
        return reuse
    suffix = max(0, prompt_len - reuse.tokens)
    short_prefix = reuse.tokens < MIN_MATRIX_REUSE_PREFIX_TOKENS
    if suffix > MAX_CHEAP_INCREMENTAL_SUFFIX_TOKENS and short_prefix:
        return PrefixReuse(RESET)
    return reuse


class SessionCache(Protocol):
    """The cache contract a slot relies on (`model.kv_cache.ModelCache`,
    `model.archs.deepseek4.cache.Deepseek4Cache`)."""

    position: int
    capacity_step: int

    @property
    def capacity(self) -> int: ...

    @property
    def is_poisoned(self) -> bool: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def snapshot(self) -> Any: ...

    def restore(self, snapshot: Any) -> None: ...

    def reset(self) -> None: ...

    def grow(self, capacity: int, snapshot: Any = None) -> Any: ...


class SlotTaken(RuntimeError):
    """A prefill was stepped after a later `session_prefill` took over its slot."""


@dataclass(eq=False)
class SessionSlot:
    """One session's retained state on one worker.

    The turn anchor is a whole-cache snapshot at a prompt's ``recovery_position`` (a chunk
    ends there), because a chat template may rewrite the last tokens of a turn. Rollback
    goes only through the anchor or a reset, never by trimming the cache: a ring that has
    wrapped past a position cannot give its rows back, so a prompt that is a strict prefix
    of the committed tokens restores the anchor or resets.

    Attributes:
        cache: its KV cache; ``cache.position == len(committed)`` unless a chunk failed.
        committed: the exact token ids in the cache, ``[0, position)``.
        hidden: float ``(1, hidden)``, the final hidden state after the last committed token
            (so an exact hit needs only the output head), None when nothing is committed.
        anchor: a cache snapshot at ``len(anchor_tokens)`` (the turn anchor), or None.
        anchor_tokens: the ids before the anchor; `anchor_hidden` the hidden state there.
    """

    cache: SessionCache
    committed: list[int] = field(default_factory=list)
    hidden: mx.array | None = None
    anchor: Any = None
    anchor_tokens: list[int] = field(default_factory=list)
    anchor_hidden: mx.array | None = None
    owner: Prefill | None = field(default=None, repr=False)

    @classmethod
    def allocate(cls, model: PrefillModel, n_tokens: int, *, kv_dtype: mx.Dtype,
                 context_length: int, capacity_step: int | None = None) -> SessionSlot:
        """An empty slot whose cache holds `n_tokens` rounded up to the capacity step
        (`capacity_step`, default the cache's own)."""
        # capacity 0 allocates no global rows; a DeepSeek-V4 cache allocates one step
        cache = model.make_cache(kv_dtype, capacity=0, context_length=context_length,
                                 capacity_step=capacity_step)
        step = capacity_step or cache.capacity_step
        capacity = cache_capacity_for_request(context_length, 0, n_tokens, 1, step)
        if capacity > cache.capacity:
            cache = model.make_cache(kv_dtype, capacity=capacity, context_length=context_length,
                                     capacity_step=capacity_step)
        return cls(cache)

    @property
    def nbytes(self) -> int:
        """Bytes this slot holds: the cache, the anchor's copies and the hidden states (what
        a worker's ``--session-bytes`` bounds)."""
        total = self.cache.nbytes + (0 if self.anchor is None else self.anchor.nbytes)
        hiddens = {id(h): h for h in (self.hidden, self.anchor_hidden) if h is not None}
        return total + sum(h.nbytes for h in hiddens.values())

    @property
    def is_empty(self) -> bool:
        return not self.committed and not self.anchor_tokens

    def _live_position(self) -> int:
        # a chunk in flight has written rows no committed token accounts for
        ok = not self.cache.is_poisoned and not self.cache.in_flight and self.hidden is not None
        return self.cache.position if ok else -1

    def _anchor_position(self) -> int:
        return 0 if self.anchor is None else self.anchor.position

    def reusable_prefix_len(self, prompt: Sequence[int]) -> int:
        """Tokens of `prompt` this slot can resume: the longer of the live prefix and the
        anchor (hf2q ``Deepseek4Session.reusable_prefix_len``, the routing affinity)."""
        live = select_prefix_reuse(prompt, self.committed, self._live_position(), (), 0)
        anchor = select_prefix_reuse(prompt, (), -1, self.anchor_tokens, self._anchor_position())
        return max(live.tokens, anchor.tokens)

    def choose(self, prompt: Sequence[int]) -> PrefixReuse:
        """The reuse `session_prefill` applies for `prompt` (select, then prefer a matrix)."""
        selected = select_prefix_reuse(prompt, self.committed, self._live_position(),
                                       self.anchor_tokens, self._anchor_position())
        return prefer_matrix_prefill(len(prompt), selected)

    def reset(self) -> None:
        """Drop everything: the cache back to position 0, no committed tokens, no anchor."""
        self.cache.reset()
        self._forget()

    def _forget(self) -> None:
        self.committed, self.hidden = [], None
        self.anchor, self.anchor_tokens, self.anchor_hidden = None, [], None

    def _apply(self, reuse: PrefixReuse) -> None:
        if reuse.kind == RECOVERY_ANCHOR:
            self.cache.restore(self.anchor)  # whole snapshot: rings, compressor state
            self.committed, self.hidden = list(self.anchor_tokens), self.anchor_hidden
        elif reuse.kind == RESET:
            if self.cache.position or self.cache.is_poisoned:
                self.cache.reset()
            self._forget()

    def _grow_for(self, n_tokens: int, context_length: int, step: int | None) -> bool:
        """Grow the cache (live prefix migrated, anchor rebound) when `n_tokens` need it."""
        step = step or self.cache.capacity_step
        target = cache_capacity_for_request(context_length, self.cache.capacity, n_tokens, 1,
                                            step)
        if target <= self.cache.capacity:
            return False
        self.anchor = self.cache.grow(target, self.anchor)
        return True

    def record(self, prefill: Prefill) -> None:
        """After a committed chunk of `prefill`: committed ids, hidden state, and the turn
        anchor when the cursor sits at the prompt's recovery position."""
        assert prefill.cache is self.cache, "a prefill of another cache"
        cursor = prefill.cursor
        self.committed, self.hidden = prefill.token_ids[:cursor], prefill.hidden
        at = prefill.plan.recovery_position
        if 0 < at == cursor:
            self.anchor = None  # release the old copies before taking new ones
            self.anchor = self.cache.snapshot()
            self.anchor_tokens, self.anchor_hidden = self.committed, self.hidden


@dataclass(eq=False)
class SessionPrefill(Prefill):
    """A `Prefill` from a session's cache: each committed chunk is recorded in its `slot`
    (committed ids, hidden state, the turn anchor at ``plan.recovery_position``)."""

    slot: SessionSlot | None = field(default=None, repr=False, kw_only=True)
    chunk_tokens: int | None = field(default=None, kw_only=True)

    def step(self) -> int:
        """Run the next chunk and record it in the slot (see `Prefill.step`).

        Raises:
            SlotTaken: a later `session_prefill` owns the slot now. Whatever
                `Prefill.step` raises (a failed chunk leaves the cache poisoned, so the slot
                offers no live reuse; its committed ids stay those of the last good chunk).
        """
        if self.slot.owner is not self:
            raise SlotTaken("a later prefill of this session took its slot")
        n = super().step()
        self.slot.record(self)
        return n

    def _launchable(self, ahead: bool) -> bool:
        """As `Prefill`'s, but never behind the chunk that ends at the turn anchor: its
        snapshot needs the cache exactly at that chunk's end."""
        return super()._launchable(ahead) and not (
            self.launched and self._planned == self.plan.recovery_position)

    def run(self) -> np.ndarray:
        """Every remaining chunk, one at a time, and the final logits: each is recorded in
        the slot, and the anchor snapshot taken, with the cache exactly at the chunk's end
        (`Prefill.run`'s two chunks in flight would snapshot the next one's writes)."""
        while not self.done:
            self.step()
        return self.logits()

    def reset(self) -> None:
        """Back to cursor 0 with an emptied slot, replanned from 0 (after a failed chunk)."""
        super().reset()
        self.slot._forget()
        self.plan = plan_chunks(self.n_tokens, self.model.sliding_window,
                                chunk_tokens=self.chunk_tokens, anchor=True)
        self.cached_tokens, self.reuse = 0, COLD if self.reuse == COLD else RESET


def _session_plan(model: PrefillModel, n_tokens: int, cursor: int, chunk_tokens: int | None,
                  plan: ChunkPlan | None) -> ChunkPlan:
    """`plan`'s boundaries past `cursor` when it is for this prompt and started at or before
    `cursor`; else a fresh anchored plan from `cursor`."""
    if (plan is not None and plan.n_tokens == n_tokens and plan.start <= cursor < n_tokens
            and plan.boundaries and plan.boundaries[-1] == n_tokens):
        ends = [b for b in plan.boundaries if b > cursor]
        return ChunkPlan.from_boundaries(n_tokens, ends, start=cursor)
    return plan_chunks(n_tokens, model.sliding_window, chunk_tokens=chunk_tokens, anchor=True,
                       cursor=cursor)


# start_prefill's keywords on purpose: a session turn is the same request plus a slot.
def session_prefill(
    model: PrefillModel,
    slot: SessionSlot | None,
    token_ids: Sequence[int],
    *,
    vocab_size: int,
    context_length: int,
    chunk_tokens: int | None = None,
    kv_dtype: mx.Dtype = mx.float32,
    plan: ChunkPlan | None = None,
    capacity_step: int | None = None,
) -> tuple[Prefill, SessionSlot]:
    """Start the prefill of a session's next prompt from what `slot` retains.

    Decides the reuse (`SessionSlot.choose`), applies it (keep the live cache, restore the
    anchor, or reset), grows the cache first when the prompt needs more room
    (`cache_capacity_for_request` in steps of `capacity_step` tokens, default the cache's
    own; the live prefix migrates and the anchor stays valid), and plans the rest with a
    chunk ending at the recovery position. The returned prefill's ``cached_tokens`` is the
    cursor it starts at and ``reuse`` one of `REUSE_KINDS`: ``cold`` for a new or empty
    slot, ``exact`` when the prompt equals the committed ids (already done: its logits come
    from the kept hidden state through the output head, no forward pass), else the kind
    applied, ``grow-`` prefixed when the cache grew.

    Args:
        model: the architecture's model (`model.registry.LoadedModel.session_prefill`
            supplies the rest from a loaded model).
        slot: the session's slot on this worker, or None for a new one (allocated here).
        token_ids, vocab_size, context_length, chunk_tokens, kv_dtype: as `start_prefill`.
        plan: a plan recorded by an earlier attempt of this job; used from the reused cursor
            on when it is for this prompt and starts at or before that cursor, else the
            prefill is planned afresh (a recorded plan without a chunk end at the recovery
            position takes no anchor).
        capacity_step: tokens the cache grows by (small values make growth testable).
    Returns:
        (the prefill, the slot it writes into: `slot` itself, or the new one).
    Raises:
        ValueError: the prompt fails `model.planner.check_prompt`.
    """
    ids = check_prompt(token_ids, vocab_size, context_length)
    if slot is None:
        slot = SessionSlot.allocate(model, len(ids), kv_dtype=kv_dtype,
                                    context_length=context_length, capacity_step=capacity_step)
    cold, reuse = slot.is_empty, slot.choose(ids)
    slot._apply(reuse)
    grew = slot._grow_for(len(ids), context_length, capacity_step)
    cursor = slot.cache.position
    assert cursor == reuse.tokens == len(slot.committed), "slot out of step with its cache"
    kind = COLD if cold else (GROW if grew else "") + reuse.kind
    if cursor == len(ids):
        done = ChunkPlan(len(ids), (), recovery_position(len(ids)), start=cursor)
        prefill = SessionPrefill(model, ids, done, slot.cache, cached_tokens=cursor,
                                 reuse=EXACT, _hidden=slot.hidden, slot=slot)
    else:
        prefill = SessionPrefill(model, ids, _session_plan(model, len(ids), cursor,
                                                           chunk_tokens, plan),
                                 slot.cache, cached_tokens=cursor, reuse=kind, slot=slot,
                                 chunk_tokens=chunk_tokens)
    slot.owner = prefill
    return prefill, slot
