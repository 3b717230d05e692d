"""A worker's prefix cache across jobs (``--prefix-cache-bytes``): blocks of KV rows of the
prompts it finished, which later jobs sharing a prefix start from, no session id needed.

`PrefixBlocks.prefill` starts a job's first attempt from the longest prefix held
(`model.prefix_cache.prefix_prefill`: ``reuse`` ``prefix`` and ``cached_tokens`` in its status
and result); as a `worker.hooks.JobHooks`, it inserts a finished job's new blocks when the job
leaves. One budget covers every model the worker serves (a block's key names its model file).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from jobs.record import JobRecord
from jobs.schema import JobState
from model.prefill import Prefill
from model.prefix_cache import BLOCK_TOKENS, PrefixCache, prefix_prefill
from model.registry import LoadedModel

from .active import ActiveJob

log = logging.getLogger("prefillq.worker")


class PrefixBlocks:
    """The worker's held prefix blocks, within `max_bytes` (least recently used evicted
    first, a prefix's tail before its head: `model.prefix_cache.PrefixCache`).

    Attributes:
        reused_tokens, reused_jobs: prompt tokens restored from held blocks instead of
            computed, and the jobs that started so, since the worker started.
    Raises:
        ValueError: `max_bytes` < 0 or `block_tokens` < 1.
    """

    def __init__(self, max_bytes: int, block_tokens: int = BLOCK_TOKENS):
        self.cache = PrefixCache(max_bytes, block_tokens)
        self.reused_tokens = self.reused_jobs = 0

    def prefill(self, loaded: LoadedModel, token_ids: Sequence[int], *,
                chunk_tokens: int | None, prompt_logprobs: int | None
                ) -> tuple[Prefill, list[bytes]]:
        """A job's first start on `loaded`: its prefill from the longest held prefix of
        `token_ids`, and the keys of its blocks to insert when it finishes (empty: none).

        Raises:
            ValueError: as `model.prefix_cache.prefix_prefill` (a prompt the checks let
                through should not raise it).
        """
        prefill, keys = prefix_prefill(
            loaded.model, token_ids, self.cache, loaded.sha256, vocab_size=loaded.vocab_size,
            context_length=loaded.context_length, chunk_tokens=chunk_tokens,
            kv_dtype=loaded.dtype, prompt_logprobs=prompt_logprobs)
        if prefill.cached_tokens:
            self.reused_tokens += prefill.cached_tokens
            self.reused_jobs += 1
        return prefill, keys

    # -- JobHooks -------------------------------------------------------------------------

    def started(self, active: ActiveJob, record: JobRecord) -> None:
        pass

    def settles(self, active: ActiveJob) -> bool:
        return False

    def chunk_done(self, active: ActiveJob) -> None:
        pass

    def handing_back(self, active: ActiveJob, *, last: bool) -> None:
        pass

    def leaving(self, active: ActiveJob, ended: JobState | None) -> None:
        """Insert the new blocks of a job that finished (its cache holds every row of its
        prompt); a failure to copy them is logged and costs only later reuse."""
        if ended != JobState.FINISHED or not active.prefix_keys:
            return
        try:
            self.cache.insert(active.prefix_keys, active.prefill.cache,
                              active.prefill.logprobs)
        except Exception:
            log.exception("job %s: its prefix blocks were not kept", active.job_id)
