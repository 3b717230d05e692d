"""`SessionSlots`: the session slots one worker keeps between a session's jobs (LRU)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from redis import Redis

from jobs import keys, scripts
from jobs.defaults import DEFAULT_SESSION_SLOTS, DEFAULT_SESSION_TTL_S
from jobs.schema import JobState
from jobs.scripts import Scripts
from model.registry import LoadedModel

from .checkpoints.sessions import SessionCheckpoints

log = logging.getLogger("prefillq.worker")


@dataclass
class _Kept:
    model: str
    slot: Any  # model.session.SessionSlot (anything with ``nbytes``)


class SessionSlots:
    """A worker's kept session slots, with the Redis record of which worker holds each.

    A slot (`model.session.SessionSlot`) is a session's KV cache, the exact token ids
    committed into it, the state to recompute its last logits, and its turn anchor; the next
    job of the session prefills only what its prompt adds (`model.session.session_prefill`
    decides how much it reuses). While a slot is kept, Redis names this worker as the
    session's holder (``keys.session_holder``), so the client routes the session's next job
    to this worker's own queue; routing stops when the worker's heartbeat does, and the
    slots die with the process. A slot is checked out (`take`) while its job is resident and
    kept again when the job leaves (`leaving`), finished or not: a slot is consistent after
    every chunk. The least recently used slot is evicted first past ``max_slots`` or
    ``max_bytes`` (``SessionSlot.nbytes``: KV rows and the anchor's copies); a slot belongs to
    one session id and one model.

    Args:
        connection: Redis connection.
        worker: this worker's name (what the holder key records).
        max_slots: slots kept at once (0 keeps none: every session job runs cold).
        max_bytes: total ``nbytes`` of the kept slots, or None for no byte bound.
        ttl_s: lifetime of a holder key after the session's last job here.
        checkpoints: where a finished turn's slot is also saved, for the session's next turn
            on any worker (`worker.checkpoints.sessions.SessionCheckpoints`), or None.
    Raises:
        ValueError: `max_slots` < 0 or `max_bytes` < 0.
    """

    def __init__(self, connection: Redis, worker: str, *,
                 max_slots: int = DEFAULT_SESSION_SLOTS, max_bytes: int | None = None,
                 ttl_s: int = DEFAULT_SESSION_TTL_S,
                 checkpoints: SessionCheckpoints | None = None):
        if max_slots < 0 or (max_bytes is not None and max_bytes < 0):
            raise ValueError(f"session bounds must be >= 0: slots {max_slots}, bytes {max_bytes}")
        self.connection, self.worker = connection, worker
        self.max_slots, self.max_bytes, self.ttl_s = max_slots, max_bytes, ttl_s
        self.checkpoints = checkpoints
        self._kept: OrderedDict[str, _Kept] = OrderedDict()  # least recently used first
        self._scripts = Scripts(connection)

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, session: str) -> bool:
        return session in self._kept

    @property
    def nbytes(self) -> int:
        """Bytes of every kept slot."""
        return sum(k.slot.nbytes for k in self._kept.values())

    def take(self, session: str, model: str) -> Any | None:
        """Check out `session`'s slot for a job of `model` (None when none is kept; a slot of
        another model is dropped). The holder key keeps naming this worker meanwhile."""
        kept = self._kept.pop(session, None)
        if kept is None:
            return None
        if kept.model != model:
            log.info("session %s moved from model %s to %s: its slot is dropped", session,
                     kept.model, model)
            return None
        return kept.slot

    def claim(self, session: str) -> None:
        """Record this worker as `session`'s holder now (its job runs here), so the session's
        next job, submitted as soon as this one finishes, is routed here."""
        self.connection.set(keys.session_holder(session), self.worker, ex=self.ttl_s)

    def keep(self, session: str, model: str, slot: Any) -> list[str]:
        """Keep `slot` as `session`'s, most recently used, and record this worker as its
        holder; then evict least recently used slots past the bounds. Returns the sessions
        evicted (`session` itself when its slot alone is over ``max_bytes``)."""
        self._kept.pop(session, None)
        self._kept[session] = _Kept(model, slot)
        evicted = []
        while self._kept and (len(self._kept) > self.max_slots or self._over_bytes()):
            gone, _ = self._kept.popitem(last=False)
            evicted.append(gone)
        with self.connection.pipeline(transaction=False) as pipe:
            if session not in evicted:
                pipe.set(keys.session_holder(session), self.worker, ex=self.ttl_s)
            for gone in evicted:
                self._scripts.run(scripts.release(keys.session_holder(gone), self.worker),
                                  client=pipe)
            pipe.execute()
        for gone in evicted:
            log.info("evicted session slot %s (%d slots, %d bytes kept)", gone,
                     len(self._kept), self.nbytes)
        return evicted

    def take_or_restore(self, session: str, loaded: LoadedModel) -> Any | None:
        """`take` `session`'s slot, else restore its checkpointed one (None: neither)."""
        slot = self.take(session, loaded.name)
        if slot is None and self.checkpoints is not None:
            slot = self.checkpoints.load(session, loaded)
        return slot

    # -- a job's life (`worker.hooks.JobHooks`) -----------------------------------------

    def started(self, active, record) -> None:
        """A session job runs here now: its holder key names this worker before its publish,
        so the session's next turn, submitted as soon as this one finishes, is routed here."""
        if active.session is not None:
            self.claim(active.session)

    def settles(self, active) -> bool:
        """Never: a slot is kept at its job's last commit however it leaves."""
        return False

    def chunk_done(self, active) -> None:
        """Nothing to do: a slot is consistent after every chunk."""

    def handing_back(self, active, *, last: bool) -> None:
        """Nothing to do: the slot is kept when the job leaves."""

    def leaving(self, active, ended: JobState | None) -> None:
        """Keep the slot `active` checked out, at its last committed chunk, finished or not;
        a ``finished`` turn's slot is checkpointed too."""
        if active.slot is None:
            return
        if ended == JobState.FINISHED and self.checkpoints is not None:
            self.checkpoints.save(active.session, active.model, active.slot)
        self.keep(active.session, active.model.name, active.slot)

    def release(self, session: str) -> None:
        """Forget `session` here: drop its slot (kept or checked out) and its holder key."""
        self._kept.pop(session, None)
        self._scripts.run(scripts.release(keys.session_holder(session), self.worker))

    def _over_bytes(self) -> bool:
        return self.max_bytes is not None and self.nbytes > self.max_bytes
