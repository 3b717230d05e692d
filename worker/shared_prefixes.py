"""The shared tier of the prefix cache (``--prefix-store``): the blocks a worker keeps, also
written to a store every worker reads (the queue's Redis, another Redis or a directory:
`worker.checkpoints.store`), so a worker that does not hold a prefix can fetch its blocks
instead of computing them.

A fetch is used only while it is measured cheaper than computing on this worker's model and
device: `SharedBlocks` keeps a moving average of the seconds a fetched token costs (the
store's round trips, decoding, the copy in) and of those a computed token costs (each
chunk's seconds over its tokens, `chunk_done`), and fetches only while the first is below
the second (or not measured yet). On a CPU a fetch is far cheaper than a forward pass; on a
GPU the two can be close (docs/benchmarks.md measures both).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

from jobs import keys
from jobs.serializer import DECODE_ERRORS, packb, unpackb
from model.cache import CacheStateError
from model.prefix_cache import PrefixBlock, PrefixCache
from model.prefix_state import block_from_state, block_state

from .checkpoints.store import CheckpointStore

log = logging.getLogger("prefillq.worker")

# A block in the store outlives its last write by this long (a worker keeping it writes it
# again only after it was evicted here and kept anew).
BLOCK_TTL_S = 3600
# Weight of the newest measurement in each moving average.
EWMA = 0.2
# Keys of blocks written to the store this worker remembers, to write each once.
WRITTEN_KEYS = 65_536


class SharedBlocks:
    """A prefix cache's shared tier over `store` (see the module docstring).

    Attributes:
        fetch_s_per_token, compute_s_per_token: the moving averages (None: not measured).
        fetched_tokens: prompt tokens fetched instead of computed, since the worker started.
    """

    def __init__(self, store: CheckpointStore, ttl_s: int = BLOCK_TTL_S):
        self.store, self.ttl_s = store, ttl_s
        self.fetch_s_per_token: float | None = None
        self.compute_s_per_token: float | None = None
        self.fetched_tokens = 0
        self._written: OrderedDict[bytes, None] = OrderedDict()

    @property
    def pays(self) -> bool:
        """Whether a fetch is (or may be) cheaper than computing the same tokens."""
        return (self.fetch_s_per_token is None or self.compute_s_per_token is None
                or self.fetch_s_per_token < self.compute_s_per_token)

    def computed(self, seconds: float, tokens: int) -> None:
        """A chunk of `tokens` took `seconds` (its wall time: an upper bound of its share of
        a packed step)."""
        if tokens > 0:
            self.compute_s_per_token = _average(self.compute_s_per_token, seconds / tokens)

    def write(self, cache: PrefixCache, block_keys: Sequence[bytes]) -> None:
        """Write the blocks of `block_keys` that `cache` holds and this worker has not
        written yet. A write the store refuses is logged and costs only later fetches."""
        for key in block_keys:
            block = cache.get(key)
            if block is None or key in self._written:
                continue
            try:
                self.store.put(keys.prefix_block(key), packb(block_state(block)), self.ttl_s)
            except Exception as e:
                log.warning("prefix block %s not shared: %r", key.hex(), e)
                return
            self._written[key] = None
            if len(self._written) > WRITTEN_KEYS:
                self._written.popitem(last=False)

    def fetch(self, block_keys: Sequence[bytes], n_layers: int, block_tokens: int,
              k: int | None) -> tuple[list[bytes], list[PrefixBlock]]:
        """The blocks of `block_keys` the store holds, from the first, until one is missing,
        does not decode (logged) or kept fewer than `k` prompt logprobs (None: any); the
        time they took per token goes into the average."""
        t0 = time.perf_counter()
        got: list[PrefixBlock] = []
        for key in block_keys:
            try:
                blob = self.store.get(keys.prefix_block(key))
                if blob is None:
                    break
                block = block_from_state(unpackb(blob), n_layers)
            except (CacheStateError, *DECODE_ERRORS) as e:
                log.warning("prefix block %s in the store does not decode: %s", key.hex(), e)
                break
            except Exception as e:  # the store is unreachable: compute instead
                log.warning("prefix blocks not fetched: %r", e)
                break
            if k is not None and (block.logprobs is None or block.logprobs.k < k):
                break
            got.append(block)
        if got:
            tokens = len(got) * block_tokens
            self.fetch_s_per_token = _average(self.fetch_s_per_token,
                                              (time.perf_counter() - t0) / tokens)
            self.fetched_tokens += tokens
        return list(block_keys[: len(got)]), got


def _average(mean: float | None, x: float) -> float:
    return x if mean is None else (1 - EWMA) * mean + EWMA * x
