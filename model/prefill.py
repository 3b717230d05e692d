"""One job's cold prefill, advanced one bounded chunk at a time.

mlx-lm's prefill loop (slice, forward, ``mx.eval`` the cache, report progress) turned inside
out so a queue can run one chunk per call, interleave jobs between calls and stop a job at
any chunk boundary. Logits are computed once, for the last position, after the last chunk
(prompt log-probabilities run the head on every position of each chunk: `model.logprobs`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from .cache import CachePoisoned
from .chunk import (
    PrefillModel,
    eval_or_poison,
    final_logits,
    finish_chunk,
    launch_chunk,
    launch_packed,
)
from .kv_cache import ModelCache
from .planner import ChunkPlan

if TYPE_CHECKING:
    from .logprobs import PromptLogprobs


@dataclass
class Prefill:
    """A prefill in progress: token ids, chunk plan and the job's KV cache.

    The cursor is ``cache.position`` (one source of truth). Create with
    `model.start.start_prefill` (cold), `model.start.resume_prefill` (from a checkpoint) or
    `model.session.session_prefill` (from a session's retained cache).

    Attributes:
        cached_tokens: tokens the cache held when this prefill started (reused, not run).
        reuse: how they were reused: ``cold`` here; `model.session` names the others.
    """

    model: PrefillModel
    token_ids: list[int]
    plan: ChunkPlan
    cache: ModelCache
    chunks_done: int = 0
    compute_seconds: float = 0.0
    cached_tokens: int = 0  # tokens a session's slot supplied: the cursor started here
    reuse: str = "cold"  # how they were reused (`model.session`)
    resumed_from: int | None = None  # the cursor a KV checkpoint restored (a restart)
    # wall time of the last chunk: from its launch (or step), or from when the chunk before
    # it landed if it was launched behind that one, so a job's chunks never overlap in time
    last_chunk_seconds: float = 0.0
    logprobs: PromptLogprobs | None = None  # prompt log-probabilities, for jobs that ask
    # False: nothing reads the cache once the prefill is done (no session keeps it), so a
    # packed step need not write the last chunk's rows (`_writes`): a one-chunk scoring job
    # then costs no cache writes at all
    keep_cache: bool = True
    _hidden: mx.array | None = field(default=None, repr=False)
    _logits: mx.array | None = field(default=None, repr=False)  # from the last chunk's pass
    # the chunks in flight, oldest first: (start, end, (hidden, head), build seconds, launch
    # time, final logits or None), or the error building one raised
    _launched: list = field(default_factory=list, repr=False)
    _landed_at: float = field(default=0.0, repr=False)  # perf_counter of the last landing

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def cursor(self) -> int:
        return self.cache.position

    @property
    def done(self) -> bool:
        return self.cursor == self.n_tokens

    @property
    def next_chunk_tokens(self) -> int:
        """Tokens the next chunk computes (0 once done)."""
        if self.done:
            return 0
        start, end = self.plan.next_chunk(self.cursor)
        return end - start

    @property
    def launched(self) -> bool:
        """A chunk was launched and its `step` has not run yet."""
        return bool(self._launched)

    @property
    def _planned(self) -> int:
        """The cursor once the chunks in flight commit."""
        return self.cursor + self.cache.in_flight

    @property
    def hidden(self) -> mx.array | None:
        """The last committed position's final hidden state, float ``(1, hidden)``, or None."""
        return self._hidden

    def step(self) -> int:
        """Run the next chunk (or finish the oldest one `launch` started); returns the
        number of tokens it committed. A chunk launched behind it stays in flight: this one
        commits once its outputs evaluated, and its cache writes evaluate with that chunk.

        Raises:
            ValueError: the prefill is already done. Whatever `model.chunk.finish_chunk` raises
            (a launched chunk's error included).
        """
        launched = self._launched.pop(0) if self._launched else self._launch()
        if isinstance(launched, Exception):
            raise launched
        start, end, (hidden, head), build_seconds, began, logits = launched
        t0 = time.perf_counter()
        final = () if logits is None else (logits,)
        if self._launched or not self._writes(end):
            # not the cache's arrays: the next chunk's writes rebind them, or no one reads
            # them again
            eval_or_poison(self.cache, hidden, *head, *final)
            self.cache.commit(end - start)
            self._hidden = hidden
        else:
            self._hidden = finish_chunk(self.cache, hidden, end - start, (*head, *final))
        self._logits = logits
        self._landed(start, head, began, t0, build_seconds)
        return end - start

    def _landed(self, start: int, head: tuple, began: float, t0: float,
                build_seconds: float = 0.0) -> None:
        """A chunk's bookkeeping once it committed: its prompt logprobs, its compute time
        (`build_seconds` plus the wait from `t0`), its wall time (from `began`, its launch,
        or from the landing before it if it was launched behind that one) and the count."""
        if self.logprobs is not None:
            self.logprobs.record(start, head)
        done = time.perf_counter()
        self.compute_seconds += build_seconds + done - t0
        self.last_chunk_seconds = done - max(began, self._landed_at)
        self._landed_at = done
        self.chunks_done += 1

    def launch(self, ahead: bool = False) -> None:
        """Start the next chunk on the device without waiting for it, so the caller's own
        work (a queue's bookkeeping) overlaps the forward pass; the next `step` waits for it
        and commits. With `ahead`, a chunk already in flight may have one more launched
        behind it (built on top of it, `CommittedCache.ahead`), so the host builds chunk k +
        1 while the device runs chunk k, as `run` does. Does nothing once every chunk is
        committed or in flight, or when a chunk is in flight (two, with `ahead`). An error
        building the chunk is raised by its `step`, not here. The last chunk's pass also
        computes the final logits (`logits`).

        ``compute_seconds`` counts the time spent here and waiting in that `step`, not the
        caller's work in between.
        """
        if not self._launchable(ahead):
            return
        try:
            with self.cache.ahead(self.cache.in_flight):
                launched = self._launch()
        except Exception as error:  # raised where the chunk's outcome is handled
            launched = error
        self._launched.append(launched)

    def _writes(self, end: int) -> bool:
        """Whether the chunk ending at `end` must leave its rows in the cache: every chunk
        but the last of a prefill whose cache is not kept (`keep_cache`)."""
        return self.keep_cache or end < self.n_tokens

    def _launchable(self, ahead: bool) -> bool:
        """Whether `launch` would launch a chunk now."""
        return len(self._launched) < (2 if ahead else 1) and self._planned < self.n_tokens

    def abandon(self) -> None:
        """Drop the launched chunks that will not be stepped (the job ended meanwhile): the
        cache is back at the last committed chunk (`CommittedCache.abandon`), as if none had
        been launched, so it may be kept or saved. Does nothing when none is."""
        self._launched = []
        self.cache.abandon()

    @staticmethod
    def launch_all(prefills: Sequence[Prefill], ahead: bool = False) -> None:
        """`launch` the next chunk of each of `prefills` (with `ahead`, one behind a chunk
        in flight), in one packed forward pass (`model.chunk.launch_packed`) when two or
        more are ready and can share one: the same model, which packs their caches
        (``model.packs``), and no poisoned cache; else one by one. A job with prompt
        logprobs gets every position of its chunk from the pass; the jobs whose last chunk
        it is get their final logits from one pass of the output head; the last chunk of a
        job whose cache is not kept (`keep_cache`) need not write its rows. Each one's `step`
        waits for its chunk and commits it; an error building the packed pass is raised by
        every one's `step`.
        """
        ready = [p for p in prefills if p._launchable(ahead)]
        model = ready[0].model if ready else None
        packs = getattr(model, "packs", None)
        if (len(ready) < 2 or packs is None or any(p.model is not model for p in ready)
                or any(p.cache.is_poisoned for p in ready)
                or not packs([p.cache for p in ready])):
            for p in ready:
                p.launch(ahead)
            return
        spans = [p.plan.next_chunk(p._planned) for p in ready]
        t0 = time.perf_counter()
        try:
            with ExitStack() as stack:
                for p in ready:
                    stack.enter_context(p.cache.ahead(p.cache.in_flight))
                chunks = [p.token_ids[s:e] for p, (s, e) in zip(ready, spans, strict=True)]
                launched = launch_packed(model, [p.cache for p in ready], chunks,
                                         [p.logprobs for p in ready],
                                         [p._writes(e) for p, (_, e) in zip(ready, spans,
                                                                            strict=True)])
            last = [i for i, (p, (_, end)) in enumerate(zip(ready, spans, strict=True))
                    if end == p.n_tokens]
            final = final_logits(model, [launched[i][0] for i in last])
        except Exception as error:  # raised where each job's chunk outcome is handled
            for p in ready:
                p._launched.append(error)
            return
        build = (time.perf_counter() - t0) / len(ready)
        logits = dict(zip(last, final, strict=True))
        for i, (p, (start, end), out) in enumerate(zip(ready, spans, launched, strict=True)):
            p._launched.append((start, end, out, build, t0, logits.get(i)))

    def _launch(self) -> tuple:
        start, end = self.plan.next_chunk(self.cursor)
        t0 = time.perf_counter()
        out = launch_chunk(self.model, self.cache, self.token_ids[start:end], self.logprobs)
        (logits,) = final_logits(self.model, [out[0]]) if end == self.n_tokens else (None,)
        return start, end, out, time.perf_counter() - t0, t0, logits

    def run(self) -> np.ndarray:
        """Run every remaining chunk; returns the final logits, float32 ``(vocab,)``.

        Chunk k + 1 is built and launched while chunk k runs (`CommittedCache.ahead`), so
        the host's graph building, which bounds a 2,048-token GPU chunk, overlaps the device.
        A chunk commits once its outputs evaluated; cache writes off their path (a sliding
        ring's) evaluate with the next chunk or at the end, and any failure poisons the
        cache. Raises as `step`."""
        while self.launched:
            self.step()
        pending = None  # launched, not yet committed
        while pending is not None or not self.done:
            ahead = pending[1] - pending[0] if pending is not None else 0
            launched = None
            if self.cursor + ahead < self.n_tokens:
                with self.cache.ahead(ahead):
                    launched = self._launch_next()
            if pending is not None:
                self._land(*pending)
            pending = launched
        # the last chunk's cache writes (earlier ones were read by the next chunk)
        eval_or_poison(self.cache, self.cache.arrays())
        return self.logits()

    def _launch_next(self) -> tuple:
        start, end = self.plan.next_chunk(self.cache.position)
        began = time.perf_counter()
        hidden, head = launch_chunk(self.model, self.cache, self.token_ids[start:end],
                                    self.logprobs)
        self.compute_seconds += time.perf_counter() - began
        return start, end, hidden, head, began

    def _land(self, start: int, end: int, hidden: mx.array, head: tuple, began: float
              ) -> None:
        # not the cache's arrays: the next chunk's writes rebind them (no overlap then)
        t0 = time.perf_counter()
        eval_or_poison(self.cache, hidden, *head)
        self.cache.commit(end - start)
        self._hidden, self._logits = hidden, None
        self._landed(start, head, began, t0)

    def logits(self) -> np.ndarray:
        """Final-position logits, float32 ``(vocab,)``; they also complete ``logprobs``
        (its entry n: `PromptLogprobs.finish`).

        Raises:
            RuntimeError: the prefill is not done. CachePoisoned: a chunk failed (`reset`).
        """
        self._check_logits()
        if self._logits is not None:  # float32, computed in the last chunk's pass
            logits = np.array(self._logits)
        else:
            logits = np.array(self.model.logits(self._hidden).astype(mx.float32)[0])
        if self.logprobs is not None and self.logprobs.filled < self.n_tokens:
            self.logprobs.finish(logits)
        return logits

    @staticmethod
    def logits_of(prefills: Sequence[Prefill]) -> list[np.ndarray]:
        """`logits` of each of `prefills` (all done), float32 ``(vocab,)`` each: those their
        last chunk's pass computed (`launch`), and one pass of the output head over the
        final hidden states of the others sharing a model: the head's weights (Gemma 3 270M:
        262,144 x 640) are read once for the lot, not once per job.

        Raises:
            as `logits`.
        """
        out: dict[int, np.ndarray] = {}
        by_model: dict[int, list[int]] = {}
        for i, p in enumerate(prefills):
            p._check_logits()
            if p._logits is not None:  # computed in its last chunk's pass
                out[i] = p.logits()
            else:
                by_model.setdefault(id(p.model), []).append(i)
        for group in by_model.values():
            model = prefills[group[0]].model
            hidden = mx.concatenate([prefills[i]._hidden for i in group])  # (jobs, hidden)
            rows = np.array(model.logits(hidden).astype(mx.float32))
            for i, row in zip(group, rows, strict=True):
                out[i] = row
                lp = prefills[i].logprobs
                if lp is not None and lp.filled < prefills[i].n_tokens:
                    lp.finish(row)
        return [out[i] for i in range(len(prefills))]

    def _check_logits(self) -> None:
        if not self.done or self._hidden is None:
            raise RuntimeError(f"prefill at {self.cursor}/{self.n_tokens} has no logits yet")
        if self.cache.is_poisoned:
            raise CachePoisoned("a chunk of this prefill failed: reset it first")

    def reset(self) -> None:
        """Back to cursor 0 (after a failed chunk poisoned the cache)."""
        self.cache.reset()
        if self.logprobs is not None:
            self.logprobs.reset()
        self.chunks_done = 0
        self._hidden = self._logits = None
        self._launched = []
