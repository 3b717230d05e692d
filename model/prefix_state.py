"""A prefix block as bytes and back (`block_state`, `block_from_state`), so a block one worker
kept can be written to a shared store and restored by another (`worker.prefixes`).

A block is every layer's keys and values of its positions and, when the job that kept it
asked for them, its prompt log-probabilities (`model.prefix_cache.BlockLogprobs`). Arrays
travel as little-endian bytes with their shape and dtype (`model.cache_state.to_bytes`:
bit-exact), in a msgpack-able dict that names its version.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from .cache import CacheStateError
from .cache_state import DTYPES, dtype_name, from_bytes, to_bytes
from .prefix_cache import BlockLogprobs, PrefixBlock

BLOCK_STATE_VERSION = 1


def _array(a: mx.array) -> list:
    return [dtype_name(a.dtype), list(a.shape), to_bytes(a)]


def _of(entry: Any) -> mx.array:
    dtype, shape, data = entry
    if dtype not in DTYPES:
        raise CacheStateError(f"prefix block dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return from_bytes(data, DTYPES[dtype], tuple(shape))


def block_state(block: PrefixBlock) -> dict[str, Any]:
    """`block` as a msgpack-able dict of bytes and shapes (`block_from_state` reads it)."""
    lp = block.logprobs
    return {
        "version": BLOCK_STATE_VERSION,
        "rows": [[_array(k), _array(v)] for k, v in block.rows],
        "logprobs": None if lp is None else {
            "token_logprob": lp.token_logprob.astype("<f4").tobytes(),
            "top_ids": lp.top_ids.astype("<i4").tobytes(),
            "top_logprobs": lp.top_logprobs.astype("<f4").tobytes(),
            "k": lp.k, "hidden": _array(lp.hidden)},
    }


def block_from_state(state: Any, n_layers: int) -> PrefixBlock:
    """The block `block_state` gave `state`, for a cache of `n_layers` layers.

    Raises:
        CacheStateError: another version, another number of layers, or entries that do not
            decode (a store's corrupt or foreign value).
    """
    try:
        if state["version"] != BLOCK_STATE_VERSION or len(state["rows"]) != n_layers:
            raise CacheStateError(f"prefix block of version {state['version']} with "
                                  f"{len(state['rows'])} layers; want version "
                                  f"{BLOCK_STATE_VERSION} with {n_layers}")
        rows = tuple((_of(k), _of(v)) for k, v in state["rows"])
        lp, logprobs = state["logprobs"], None
        if lp is not None:
            k = int(lp["k"])
            logprobs = BlockLogprobs(
                np.frombuffer(lp["token_logprob"], "<f4").astype(np.float32),
                np.frombuffer(lp["top_ids"], "<i4").astype(np.int32).reshape(-1, k),
                np.frombuffer(lp["top_logprobs"], "<f4").astype(np.float32).reshape(-1, k),
                _of(lp["hidden"]))
    except CacheStateError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise CacheStateError(f"prefix block does not decode: {type(e).__name__}: {e}") from e
    mx.eval([a for kv in rows for a in kv], *(() if logprobs is None else (logprobs.hidden,)))
    return PrefixBlock(rows, sum(a.nbytes for kv in rows for a in kv)
                       + (0 if logprobs is None else logprobs.nbytes), logprobs)
