"""A session slot as bytes and back (`slot_state`, `slot_from_state`), so a finished
session's slot can be checkpointed and its next turn resumed by any worker.

A slot is its live cache (a complete `CacheState` at the committed position), the committed
ids and the last hidden state, and its turn anchor. The anchor is saved as the complete
cache state at the anchor's position (its append-only rows are a prefix of the live ones;
storing them again keeps this independent of each architecture's snapshot layout) plus its
tokens and hidden state; restoring builds the anchor's snapshot from it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .cache import CacheStateError
from .cache_state import CacheState, dtype_name, from_bytes, to_bytes
from .chunk import PrefillModel
from .session import SessionSlot

SLOT_STATE_VERSION = 1


def slot_state(slot: SessionSlot) -> dict[str, Any]:
    """`slot` as a msgpack-able dict of ids, metadata and bytes (a copy: the slot may change
    afterwards). Evaluates the cache.

    Raises:
        CachePoisoned: the slot's cache holds a failed chunk (there is no live state).
    """
    live = slot.cache.state()
    anchor = None
    if slot.anchor is not None:
        back = slot.cache.snapshot()
        try:
            slot.cache.restore(slot.anchor)
            anchor = slot.cache.state()
        finally:
            slot.cache.restore(back)
    return {
        "version": SLOT_STATE_VERSION,
        "committed": list(slot.committed),
        "hidden": _array(slot.hidden),
        "live": {"meta": live.meta, "blobs": live.blobs},
        "anchor": None if anchor is None else {"meta": anchor.meta, "blobs": anchor.blobs},
        "anchor_tokens": list(slot.anchor_tokens),
        "anchor_hidden": _array(slot.anchor_hidden),
    }


def slot_from_state(model: PrefillModel, state: dict[str, Any]) -> SessionSlot:
    """The slot `slot_state` saved, for `model` (its caches through ``cache_from_state``).

    Raises:
        CacheStateError: another version, a cache state that does not fit `model`, or ids
            and positions that do not agree.
    """
    try:
        if state.get("version") != SLOT_STATE_VERSION:
            raise CacheStateError(f"slot state version {state.get('version')!r}")
        cache = model.cache_from_state(CacheState(**state["live"]))
        committed = [int(t) for t in state["committed"]]
        if cache.position != len(committed):
            raise CacheStateError(f"slot cache at {cache.position} holds "
                                  f"{len(committed)} committed ids")
        slot = SessionSlot(cache, committed, _from(state["hidden"]))
        if state["anchor"] is not None:
            anchor_cache = model.cache_from_state(CacheState(**state["anchor"]))
            tokens = [int(t) for t in state["anchor_tokens"]]
            if anchor_cache.position != len(tokens) or committed[:len(tokens)] != tokens:
                raise CacheStateError("the turn anchor does not fit the committed ids")
            slot.anchor = anchor_cache.snapshot()
            slot.anchor_tokens, slot.anchor_hidden = tokens, _from(state["anchor_hidden"])
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, CacheStateError):
            raise
        raise CacheStateError(f"slot state is malformed: {type(e).__name__}: {e}") from e
    return slot


def _array(a: mx.array | None) -> dict | None:
    if a is None:
        return None
    return {"dtype": dtype_name(a.dtype), "shape": list(a.shape), "bytes": to_bytes(a)}


def _from(entry: dict | None) -> mx.array | None:
    if entry is None:
        return None
    dtype = getattr(mx, entry["dtype"])
    return from_bytes(entry["bytes"], dtype, tuple(entry["shape"]))
