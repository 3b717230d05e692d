"""A worker's prefix cache across jobs (``--prefix-cache-bytes``): blocks of KV rows of the
prompts it finished, which later jobs sharing a prefix start from, no session id needed.

`PrefixBlocks.prefill` starts a job's first attempt from the longest prefix held
(`model.prefix_cache.prefix_prefill`: ``reuse`` ``prefix`` and ``cached_tokens`` in its status
and result), or defers it while a live job is prefilling the block that would extend that
prefix (the choices of one multiple-choice question submitted together: the first computes
the context, the others start from it once it finishes); as a `worker.hooks.JobHooks`, it
inserts a finished job's new blocks when the job leaves, and publishes routing entries for
them (`jobs.prefixes`), so that `submit` sends a later job sharing the prefix here. One
budget covers every model the worker serves (a block's key names its model file).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from jobs import keys
from jobs.prefixes import BLOCK_TOKENS, ROUTE_TTL_S, block_keys, root_key, route_blocks, salted
from jobs.record import JobRecord
from jobs.schema import JobState
from model.prefill import Prefill
from model.prefix_cache import PREFIX, PrefixCache, prefix_prefill
from model.registry import LoadedModel

from .active import ActiveJob
from .checkpoints.store import open_store
from .settings import WorkerSettings
from .shared_prefixes import SharedBlocks

log = logging.getLogger("prefillq.worker")

# Published prefixes whose last write time is remembered (`PrefixBlocks._refresh`).
ROUTED_PREFIXES = 65_536


class PrefixBlocks:
    """The worker's held prefix blocks, within `max_bytes` (least recently used evicted
    first, a prefix's tail before its head: `model.prefix_cache.PrefixCache`); with a Redis
    `connection`, the routing entries of the blocks it keeps name `worker`.

    With `shared` (``--prefix-store``), the blocks it keeps are written to a store other
    workers read, and a job whose prefix is not held here fetches the blocks the store holds
    while fetching is measured cheaper than computing (`worker.shared_prefixes`).

    Attributes:
        reused_tokens, reused_jobs: prompt tokens restored from held blocks instead of
            computed, and the jobs that started so, since the worker started.
    Raises:
        ValueError: `max_bytes` < 0 or `block_tokens` < 1.
    """

    def __init__(self, max_bytes: int, connection=None, worker: str = "",
                 block_tokens: int = BLOCK_TOKENS, shared: SharedBlocks | None = None):
        self.cache = PrefixCache(max_bytes, block_tokens)
        self.connection, self.worker, self.shared = connection, worker, shared
        self.reused_tokens = self.reused_jobs = 0
        # block key -> the job that will insert it when it finishes (set at its start)
        self.capturing: dict[bytes, str] = {}
        self._layouts: dict[str, tuple[bytes, int]] = {}  # model sha256 -> root, layers
        self._started: set[str] = set()  # jobs started here, until they leave (`outcomes`)
        # a published prefix's last block key -> when its routing entries were written
        self._routed: OrderedDict[bytes, float] = OrderedDict()

    @classmethod
    def of_settings(cls, settings: WorkerSettings, connection, worker: str
                    ) -> PrefixBlocks | None:
        """A worker's prefix cache as its `settings` say (``prefix_cache_bytes``, 0: None;
        ``prefix_store``: its shared tier's store, `open_store`)."""
        if not settings.prefix_cache_bytes:
            return None
        shared = (None if settings.prefix_store is None
                  else SharedBlocks(open_store(settings.prefix_store, connection)))
        log.info("prefix cache: up to %d bytes of %d-token blocks%s",
                 settings.prefix_cache_bytes, BLOCK_TOKENS,
                 "" if shared is None else f", shared through {type(shared.store).__name__}")
        return cls(settings.prefix_cache_bytes, connection, worker, shared=shared)

    def prefill(self, loaded: LoadedModel, token_ids: Sequence[int], *, job_id: str,
                chunk_tokens: int | None, prompt_logprobs: int | None,
                live: Callable[[str], bool] = lambda job_id: False, keep_cache: bool = False,
                salt: str | None = None) -> tuple[Prefill, list[bytes]] | None:
        """Job `job_id`'s first start on `loaded`: its prefill from the longest held prefix
        of `token_ids`, and the keys of its blocks to insert when it finishes (empty: none);
        or None to defer it, when a job for which `live` holds (resident, or starting with
        it) will insert the block that would extend that prefix. With `keep_cache`, the
        last chunk writes its rows (continuations are scored from them). A job's
        ``cache_salt`` `salt` keys its blocks apart (`jobs.prefixes.salted`).

        Raises:
            ValueError: as `model.prefix_cache.prefix_prefill` (a prompt the checks let
                through should not raise it).
        """
        B = self.cache.block_tokens
        keys = block_keys(token_ids, salted(self.root(loaded), salt), B)
        reusable = keys[: (len(token_ids) - 1) // B]
        held = self.cache.longest(reusable, prompt_logprobs)
        if self.shared is not None and held < len(reusable) and self.shared.pays:
            fetched, blocks = self.shared.fetch(reusable[held:], self._layers(loaded), B,
                                                prompt_logprobs)
            if blocks:
                self.cache.add(fetched, blocks)
                held = self.cache.longest(reusable, prompt_logprobs)
        owner = self.capturing.get(reusable[held]) if held < len(reusable) else None
        if owner is not None and owner != job_id and live(owner):
            return None
        prefill, keys = prefix_prefill(
            loaded.model, token_ids, self.cache, keys, vocab_size=loaded.vocab_size,
            context_length=loaded.context_length, chunk_tokens=chunk_tokens,
            kv_dtype=loaded.dtype, prompt_logprobs=prompt_logprobs, keep_cache=keep_cache)
        self._started.add(job_id)
        for key in keys:  # an owner that is no longer live gives way
            if not live(self.capturing.get(key, job_id)):
                self.capturing[key] = job_id
        if prefill.cached_tokens:
            self.reused_tokens += prefill.cached_tokens
            self.reused_jobs += 1
            self._refresh(loaded, reusable[: prefill.cached_tokens // B])
        return prefill, keys

    def _refresh(self, loaded: LoadedModel, held: list[bytes]) -> None:
        """Publish the routing entries of a reused prefix `held` again when they were last
        written more than half their TTL ago (or never, for this prefix), so a prefix that
        keeps being reused here keeps being routed here (one round trip a prefix at most
        every ``ROUTE_TTL_S / 2`` seconds)."""
        if time.monotonic() - self._routed.get(held[-1], -ROUTE_TTL_S) > ROUTE_TTL_S / 2:
            self.publish(loaded, held)

    def outcomes(self, finished: Sequence[ActiveJob]) -> tuple[int, int]:
        """(hits, misses): how many of the `finished` jobs that started here reused a prefix
        (``reuse`` `PREFIX`) and how many reused none (a session's job, or a later attempt
        on its recorded plan, did not start here and counts as neither)."""
        mine = [a for a in finished if a.job_id in self._started]
        self._started.difference_update(a.job_id for a in mine)
        hits = sum(a.prefill.reuse == PREFIX for a in mine)
        return hits, len(mine) - hits

    def release(self, job_id: str, keys: Sequence[bytes]) -> None:
        """Job `job_id` will not insert the blocks of `keys` (it left, or was not taken):
        the jobs deferred for them start at the next admission."""
        for key in keys:
            if self.capturing.get(key) == job_id:
                del self.capturing[key]

    def root(self, loaded: LoadedModel) -> bytes:
        """The root key of `loaded`'s prompts here (`jobs.prefixes.root_key` over its file
        and its cache's layout, no salt)."""
        return self._layout(loaded)[0]

    def _layers(self, loaded: LoadedModel) -> int:
        """Layers of `loaded`'s cache (a fetched block must have as many)."""
        return self._layout(loaded)[1]

    def _layout(self, loaded: LoadedModel) -> tuple[bytes, int]:
        """`loaded`'s root key and its cache's layer count, from one empty cache a model
        file."""
        if loaded.sha256 not in self._layouts:
            cache = loaded.model.make_cache(loaded.dtype)
            self._layouts[loaded.sha256] = (root_key(loaded.sha256, cache.layout()),
                                            len(cache.layers))
        return self._layouts[loaded.sha256]

    # -- JobHooks -------------------------------------------------------------------------

    def started(self, active: ActiveJob, record: JobRecord) -> None:
        pass

    def settles(self, active: ActiveJob) -> bool:
        return False

    def chunk_done(self, active: ActiveJob) -> None:
        """A chunk's seconds per token, for the shared tier's fetch-or-compute choice."""
        if self.shared is not None:
            p = active.prefill
            ends = (p.plan.start, *p.plan.boundaries)
            if p.cursor in ends[1:]:
                self.shared.computed(p.last_chunk_seconds,
                                     p.cursor - ends[ends.index(p.cursor) - 1])

    def handing_back(self, active: ActiveJob, *, last: bool) -> None:
        pass

    def leaving(self, active: ActiveJob, ended: JobState | None) -> None:
        """Insert the new blocks of a job that finished (its cache holds every row of its
        prompt); a failure to copy them is logged and costs only later reuse. The jobs
        deferred for its blocks start at the next admission either way."""
        self.release(active.job_id, active.prefix_keys)
        self._started.discard(active.job_id)
        if ended != JobState.FINISHED or not active.prefix_keys:
            return
        try:
            self.cache.insert(active.prefix_keys, active.prefill.cache,
                              active.prefill.logprobs)
        except Exception:
            log.exception("job %s: its prefix blocks were not kept", active.job_id)
            return
        if self.shared is not None:
            self.shared.write(self.cache, active.prefix_keys)
        self.publish(active.model, active.prefix_keys)

    def publish(self, loaded: LoadedModel, prefix_keys: list[bytes]) -> None:
        """Point the routing entries of `prefix_keys`' `route_blocks` at this worker, and
        the model's root at this worker's (one round trip; best effort: an entry Redis
        refuses costs a later job only its reuse)."""
        if self.connection is None:
            return
        try:
            with self.connection.pipeline(transaction=False) as pipe:
                pipe.hset(keys.PREFIX_ROOTS, loaded.name, self.root(loaded).hex())
                pipe.hset(keys.PREFIX_BYTES, self.worker, self.cache.nbytes)
                for i in route_blocks(len(prefix_keys)):
                    pipe.set(keys.prefix_route(prefix_keys[i]), self.worker, ex=ROUTE_TTL_S)
                pipe.execute()
        except Exception as e:
            log.warning("prefix routing entries not written: %r", e)
            return
        self._routed[prefix_keys[-1]] = time.monotonic()
        self._routed.move_to_end(prefix_keys[-1])
        if len(self._routed) > ROUTED_PREFIXES:
            self._routed.popitem(last=False)
