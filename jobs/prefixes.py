"""Prefix block keys: the one definition a client (routing a job at submit) and a worker (its
prefix cache, `worker.prefixes`) share, and the routing entries that join them.

A prompt is cut into blocks of `BLOCK_TOKENS` token ids. Block i's key is SHA-256 of block
i - 1's key and its ids as little-endian int32, `KEY_BYTES` bytes; the first block's parent
is the root, SHA-256 over the model file's sha256 and the worker's cache layout
(architecture, KV dtype, layer shapes), or a job's ``cache_salt`` hashed into that root
(`salted`): jobs of different salts never share a block. So a key names one prefix of one
model's cache, the same in every process and on every machine (no Python ``hash``, no
per-process seed).

A worker with a prefix cache publishes its root per model (``keys.PREFIX_ROOTS``) and, for
the blocks it keeps, a few routing entries (``keys.prefix_route``: the holder's name, expiring
after `ROUTE_TTL_S`): the keys of blocks 1, 2, 4, 8, ... and of the last (`route_blocks`), so a
prompt of n blocks costs O(log n) entries and a lookup finds its longest routed prefix to
within a factor of two. A stale entry costs a cold prefill elsewhere, never a wrong result.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence

BLOCK_TOKENS = 32
KEY_BYTES = 16
ROUTE_TTL_S = 600  # a routing entry outlives its last refresh by this long
# A holder with this many jobs waiting in its own queue has no room: a job goes to intake
# instead, where any worker takes it (a worker's resident jobs, `DEFAULT_MAX_ACTIVE`, are
# as many; one more waiting behind them costs more than a cold prefill elsewhere saves).
ROUTE_MAX_WAITING = 8
_KEY_VERSION = "prefillq prefix v1"


def root_key(model_sha256: str, layout: dict) -> bytes:
    """The parent of a prompt's first block: SHA-256 over the model file's `model_sha256`
    (hex) and the cache `layout` (``ModelCache.layout()``: architecture, KV dtype, layer
    shapes), `KEY_BYTES` bytes."""
    text = json.dumps({"v": _KEY_VERSION, "model": model_sha256, "layout": layout},
                      sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).digest()[:KEY_BYTES]


def salted(root: bytes, salt: str | None) -> bytes:
    """The root of the prompts of jobs with ``cache_salt`` `salt`: SHA-256 over `root` and
    the salt's UTF-8 (`root` itself for None), `KEY_BYTES` bytes. A client computes it from
    the root a worker publishes, so a salted job is routed too; without the salt no one can
    name its blocks (vLLM's ``cache_salt`` is the same idea)."""
    if salt is None:
        return root
    return hashlib.sha256(root + b"\0salt\0" + salt.encode()).digest()[:KEY_BYTES]


def block_keys(token_ids: Sequence[int], root: bytes, block_tokens: int = BLOCK_TOKENS
               ) -> list[bytes]:
    """The key of each whole block of `token_ids` (a partial last block has none), `KEY_BYTES`
    bytes each.

    Raises:
        ValueError: `block_tokens` < 1. struct.error: an id outside int32.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be at least 1, not {block_tokens}")
    keys, parent = [], root
    pack = struct.Struct(f"<{block_tokens}i").pack
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        block = pack(*token_ids[start : start + block_tokens])
        parent = hashlib.sha256(parent + block).digest()
        keys.append(parent[:KEY_BYTES])
    return keys


def route_blocks(n_blocks: int) -> list[int]:
    """The indices of a prompt's blocks that carry routing entries: 0, 1, 3, 7, ... (the
    ends of the first 1, 2, 4, 8, ... blocks) below `n_blocks`, and the last."""
    ends = [(1 << i) - 1 for i in range(n_blocks.bit_length()) if (1 << i) - 1 < n_blocks]
    return sorted({*ends, n_blocks - 1}) if n_blocks else []
