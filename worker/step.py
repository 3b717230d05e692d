"""`Stepper`: the chunk step of a worker's resident jobs and their fenced transitions."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from jobs import scripts, stats
from jobs.queues import requeue_to_intake
from jobs.result import logits_blob
from jobs.schema import JobState, LogitsMode, now
from jobs.scripts import Fence, Scripts
from model.prefill import Prefill
from model.registry import LoadedModel

from .active import ActiveJob, prompt_logprobs_of_prefill, result_of, score
from .checkpoints.checkpointing import Checkpointing
from .connection import refused_write
from .faults import FaultPlan
from .hooks import JobHooks
from .parked import ParkedWrites
from .prefixes import PrefixBlocks
from .roundtrip import Departures, Probe, Reply, run_scripts
from .scheduler import Scheduler, Step
from .sessions import SessionSlots
from .settings import WorkerSettings
from .starts import Starts

log = logging.getLogger("prefillq.worker")

# error.type of a job whose transition Redis refused to write (maxmemory, value too large)
REDIS_OOM = "RedisOutOfMemory"


class Stepper(Starts):
    """Runs chunks of the jobs resident on worker `name` and records their transitions.

    A job popped from intake (in bulk, or the one that woke an idle worker: never an RQ
    execution) is admitted here (`admit`): its record is decoded
    (`worker.intake.read_records`: one that does not decode fails with ``CorruptJob``),
    checked again as `submit` checks it, tokenized, validated and
    planned (`worker.prepare`), its cache allocated, and it is taken atomically
    (``queued -> prefilling``, `jobs.scripts.start`; the chunk plan recorded at its first
    start is reused by every later one). Its chunks run in the steps the scheduler picks
    (`worker.scheduler`, `run`), several jobs' chunks to a step where ``max_batch_jobs``
    allows. Steps are pipelined: step k + 1 is launched on the device before step k's one
    round trip (`worker.roundtrip`), which records every stepped job's cursor or publishes
    its logits (a fenced script each; canceled wins), counts the chunks (`jobs.stats`), and
    reads the other jobs' cancel flags and whether intake holds a job. A launched chunk
    reaches a cache, slot, checkpoint or result only once it evaluated and its job is still
    resident; a job that leaves first abandons it. KV checkpoints, session slots and the
    prefix cache follow each job through `worker.hooks.JobHooks`.

    Every transition is fenced on (worker, attempt) (`jobs.scripts`). A write Redis refuses
    (`worker.connection.refused_write`) fails that job with ``RedisOutOfMemory``, or, when
    that write is refused too, is parked and retried (`worker.parked`) until it lands.

    Args:
        connection: Redis connection (bytes replies).
        name: the worker's name (the fencing token's worker part).
        models: loaded models by registry name.
        scheduler: the worker's scheduler: it owns the resident jobs and their turns, and
            names the queues whose lengths ride along with every step's round trip.
        settings: the worker's settings (its chunk cap, TTLs and limits are used here).
        sessions: the session slots this worker keeps (None: session jobs run cold).
        checkpointing: this worker's KV checkpoints (None: none are written or resumed).
        faults: the test-only fault plan (`worker.faults`); None in production.
    """

    def __init__(self, connection, name: str, models: dict[str, LoadedModel],
                 scheduler: Scheduler, settings: WorkerSettings, *,
                 sessions: SessionSlots | None = None,
                 checkpointing: Checkpointing | None = None, faults: FaultPlan | None = None):
        self.connection, self.name, self.models = connection, name, models
        self.faults, self.sessions, self.checkpointing = faults, sessions, checkpointing
        # the prefix cache across jobs (``settings.prefix_cache_bytes``), None when off
        self.prefixes = PrefixBlocks.of_settings(settings, connection, name)
        # what follows each job's life besides its chunks (`JobHooks`), told in this order
        self.hooks: tuple[JobHooks, ...] = tuple(
            h for h in (checkpointing, sessions, self.prefixes) if h is not None)
        self.scheduler = scheduler
        self.chunk_tokens, self.limits = settings.chunk_tokens, settings.limits
        self.result_ttl_s, self.logits_ttl_s = settings.result_ttl_s, settings.logits_ttl_s
        self.scripts = Scripts(connection)
        self.active = scheduler.resident  # read here; changed through the scheduler only
        self.parked = ParkedWrites()  # transitions Redis refused, retried by `settle`
        # jobs a step's scripts ended, forgotten in Redis by the next round trip
        self.departed = Departures(name)

    # -- the chunk step -----------------------------------------------------------------

    def admit(self, job_ids: Sequence[str]) -> None:
        """Start the jobs of `job_ids` (taken from the queues together, or the one an RQ
        execution of ``advance_prefill`` names): they are resident then, and their first
        chunks run together in the next step the scheduler picks (`run`). A write Redis
        refuses fails or parks its job, never the worker or the other jobs."""
        fresh = [j for j in dict.fromkeys(job_ids) if j not in self.active]
        if len(fresh) < len(job_ids):  # a stray execution: the resident loop owns the job
            log.debug("jobs %s are resident already", sorted(set(job_ids) - set(fresh)))
        started = self.start(fresh)
        done = [active for active in started if active.prefill.done]
        if done:  # exact session hits: no chunk to run
            reply = self.publish(done, self.scheduler.probe([]))
            self.scheduler.saw(reply)

    def score(self, done: list[ActiveJob], logits: dict[str, np.ndarray]) -> None:
        """Score the continuations of the `done` jobs that have them (`worker.active.score`);
        a job whose scoring raises is handed back as a failed chunk's is (`chunk_failed`)
        and leaves `logits`."""
        for active in done:
            try:
                score(active, logits[active.job_id], self.chunk_tokens)
            except Exception as error:  # the job's boundary: record it, keep serving
                del logits[active.job_id]
                self._guarded(active.job_id, self.chunk_failed, active, error)

    def run(self, step: Step) -> None:
        """Run one chunk of each job of `step` (the scheduler's `Run`), pipelined as
        ``Prefill.run`` is: the step's chunks are launched (one packed forward pass where
        the model packs, `Prefill.launch_all`; as a rule the previous step's `run` launched
        them already), then the next step is built and launched behind them
        (`launch_next`), so the host builds step k + 1 while the device runs step k; then
        step k's chunks are waited for and committed, due KV checkpoints copy their rows,
        and one Redis round trip records the step (`record_step`) while the device runs step
        k + 1. The final logits of the jobs a step completes come from its own pass. A job
        whose checkpoint is due after this chunk gets its next chunk only after the copy."""
        Prefill.launch_all([active.prefill for active in step.jobs])
        self.launch_next(ahead=True)
        landed = [(active, n) for active in step.jobs if (n := self._land(active))]
        done = [active for active, _ in landed if active.prefill.done]
        logits = dict(zip([a.job_id for a in done],
                          Prefill.logits_of([a.prefill for a in done]), strict=True))
        self.score(done, logits)
        landed = [(active, n) for active, n in landed if active.job_id in self.active]
        for active, _ in landed:
            if not active.prefill.done:
                for hook in self.hooks:
                    hook.chunk_done(active)
        self.launch_next()  # those a checkpoint held back
        self.record_step(landed, logits)

    def launch_next(self, ahead: bool = False) -> None:
        """Start the step whose turn it is on the device without waiting
        (`Prefill.launch_all`), so what runs before it is run (the step before, its round
        trip, admissions) overlaps its forward pass; with `ahead`, behind the chunks in
        flight, except for a job a hook wants settled after its chunk (`JobHooks.settles`:
        a KV checkpoint due). The turn order is unchanged; a job that leaves first abandons
        its launched chunks (`drop`)."""
        step = self.scheduler.next_step()
        if step is None:
            return
        jobs = [active for active in step.jobs
                if not (ahead and any(hook.settles(active) for hook in self.hooks))]
        Prefill.launch_all([active.prefill for active in jobs], ahead=ahead)

    def _land(self, active: ActiveJob) -> int | None:
        """Wait for `active`'s launched chunk and commit it; returns its tokens, or None
        when it failed (the job is handed back or failed: `chunk_failed`)."""
        p = active.prefill
        try:
            n = p.step()
        except Exception as error:  # the job's boundary: record it, keep serving
            self._guarded(active.job_id, self.chunk_failed, active, error)
            return None
        dt = max(p.last_chunk_seconds, 1e-9)  # a launched chunk: from its launch
        log.info(
            "job %s chunk %d: %d/%d tokens, %.0f ms, %.0f tok/s",
            active.job_id, p.chunks_done, p.cursor, p.n_tokens, dt * 1e3, n / dt,
        )
        return n

    def record_step(self, landed: list[tuple[ActiveJob, int]],
                    logits: dict[str, np.ndarray]) -> None:
        """One round trip for a step's `landed` chunks, ``(job, tokens)`` each: every job's
        progress, or its publish where `logits` holds its final logits, the chunks' stats,
        the other resident jobs' cancel flags and whether intake holds a job (`record`); a
        job canceled meanwhile is then released, within one step of its cancel."""
        if not landed:
            return
        stepped = {active.job_id for active, _ in landed}
        probe = self.scheduler.probe([j for j in self.active if j not in stepped],
                                     leaving=bool(logits),
                                     chunks=[(max(active.prefill.last_chunk_seconds, 1e-9), n)
                                             for active, n in landed])
        reply = self.record([active for active, _ in landed], probe, logits)
        self.scheduler.saw(reply)
        for other in reply.canceled:
            if other in self.active:
                self.advance_cancel(self.active[other])

    def advance_cancel(self, active: ActiveJob) -> None:
        """Record `canceled` for a resident job (its own refused write parks it only)."""
        self.record([active])

    def _guarded(self, job_id: str, step, *args) -> None:
        try:
            step(*args)
        except Exception as error:
            if not refused_write(error):
                raise
            self._refused(job_id, error)

    # -- transitions --------------------------------------------------------------------

    def _fence(self, active: ActiveJob) -> Fence:
        return Fence(self.name, active.attempt)

    def record(self, jobs: list[ActiveJob], probe: Probe | None = None,
               logits: dict[str, np.ndarray] | None = None) -> Reply:
        """Record each of `jobs`' progress, or publish its final logits and ``finished``
        where `logits` has them (float32 ``(vocab,)`` by job id), fenced, canceled winning,
        in one round trip with `probe`'s reads (`worker.roundtrip.run_scripts`) and the jobs
        that left since the last one (`departed`). A job whose script ended it
        (``finished``, ``canceled``) or found it fenced is dropped here and forgotten in
        Redis by the next round trip (`leave`); one whose write Redis refused is failed or
        parked (`_refused`), the others recorded.

        Raises:
            the first Redis error other than a refused write (after the rest are handled).
        """
        logits = logits or {}
        calls = [self._publish_call(a, logits[a.job_id]) if a.job_id in logits
                 else self._progress_call(a) for a in jobs]
        with self.departed.taken() as departed:
            probe = replace(probe or Probe(), departed=departed or None, resident=self.active)
            reply = run_scripts(self.connection, self.scripts, calls, probe)
        error, refused, leaving = None, [], []
        for active, outcome in zip(jobs, reply.outcomes, strict=True):
            p = active.prefill
            if isinstance(outcome, Exception):
                if refused_write(outcome):
                    refused.append((active.job_id, outcome))
                else:
                    error = error or outcome
            elif active.job_id in logits:
                leaving.append((active, stats.terminal(outcome)))
                log.info("job %s %s: %d tokens in %d chunks, %.2f s", active.job_id, outcome,
                         p.n_tokens, p.chunks_done, now() - active.first_started_at)
            elif outcome != "continue":
                log.info("job %s %s at %d/%d", active.job_id, outcome, p.cursor, p.n_tokens)
                leaving.append((active, stats.terminal(outcome)))
        if leaving:
            self.leave(leaving, later=True)
        for job_id, refusal in refused:
            self._refused(job_id, refusal)
        if error is not None:
            raise error
        return reply

    def publish(self, jobs: list[ActiveJob], probe: Probe | None = None) -> Reply:
        """Publish the final logits and ``finished`` of `jobs`, whose prefills are done
        (`record`)."""
        logits = dict(zip([a.job_id for a in jobs], Prefill.logits_of([a.prefill for a in jobs]),
                          strict=True))
        self.score(jobs, logits)
        return self.record([a for a in jobs if a.job_id in logits], probe, logits)

    def _progress_call(self, active: ActiveJob):
        p = active.prefill
        return scripts.progress(
            active.job_id, self._fence(active), now=now(), ttl_s=self.result_ttl_s,
            cursor=p.cursor, chunks_done=p.chunks_done, n_tokens=p.n_tokens,
            recovery_position=p.plan.recovery_position)

    def _publish_call(self, active: ActiveJob, logits: np.ndarray):
        p = active.prefill
        finished = now()
        prefill_s = max(finished - active.first_started_at, 1e-9)
        full = b""
        if active.logits_mode == LogitsMode.FULL:
            full = logits_blob(np.asarray(logits, dtype="<f4").tobytes())
        call = scripts.publish(
            active.job_id, self._fence(active), now=finished, ttl_s=self.result_ttl_s,
            result=result_of(active, logits, prefill_s), logits=full,
            logits_ttl_s=self.logits_ttl_s, cursor=p.cursor, chunks_done=p.chunks_done,
            prompt_logprobs=prompt_logprobs_of_prefill(p))
        if self.faults is not None:
            self.faults.pause("before_publish", job_id=active.job_id, n_tokens=p.n_tokens,
                              attempt=active.attempt)
        return call

    def fail(self, job_id: str, fence: Fence, error_type: str, message: str) -> None:
        """Record ``failed`` with ``error.type`` `error_type` (fenced) and forget the job."""
        outcome = self.scripts.run(scripts.fail(job_id, fence, now=now(),
                                                ttl_s=self.result_ttl_s,
                                                error_type=error_type, message=message))
        ended = stats.terminal(outcome)
        active = self.scheduler.remove(job_id)
        self.departed.merge(Departures(self.name, [job_id], Counter([ended] if ended else [])))
        self.forget_departed()
        if active is not None:
            for hook in self.hooks:
                hook.leaving(active, ended)
        log.warning("job %s failed: %s: %s", job_id, error_type, message[:200])

    def chunk_failed(self, active: ActiveJob, error: Exception) -> None:
        """A chunk raised: the cache is poisoned. Back to intake (to resume from its latest
        checkpoint, else cursor 0), or `failed` with ``ModelError`` once the job's failures
        reach ``max_attempts``."""
        log.error("job %s: chunk failed at %d/%d", active.job_id, active.prefill.cursor,
                  active.prefill.n_tokens, exc_info=error)
        for hook in self.hooks:  # the restart sees the checkpoint in flight
            hook.handing_back(active, last=False)
        self.requeue(active, failure=("ModelError", f"{type(error).__name__}: {error}"))

    def requeue(self, active: ActiveJob, failure: tuple[str, str] | None = None) -> None:
        """Hand `active` back to intake (its cache dies here); `failure` counts toward
        ``max_attempts`` as ``(error type, message)``, a hand-back (None) does not."""
        call = scripts.requeue(active.job_id, self._fence(active), now=now(),
                               ttl_s=self.result_ttl_s, failure=failure)
        with self.connection.pipeline() as pipe:
            pipe.multi()
            self.scripts.run(call, client=pipe)
            requeue_to_intake(self.connection, active.job_id, pipe)
            outcome = pipe.execute()[0].decode()
        log.info("job %s handed back: %s", active.job_id, outcome)
        self.drop(active, ended=stats.terminal(outcome))

    def hand_back_active(self) -> None:
        """Requeue every resident job to intake (warm shutdown). A hand-back Redis refuses
        is parked (`parked`); one that fails otherwise leaves the job in `active`."""
        for active in list(self.active.values()):
            for hook in self.hooks:  # another worker continues from here
                hook.handing_back(active, last=True)
            try:
                self.requeue(active)
            except Exception as error:
                if not refused_write(error):
                    log.error("could not hand back job %s: %s: %s", active.job_id,
                              type(error).__name__, error)
                    continue
                self.drop(active, deregister=False)
                self.parked.park(active.job_id, "hand-back", lambda a=active: self.requeue(a),
                           error)

    def drop(self, active: ActiveJob, *, deregister: bool = True,
             ended: JobState | None = None) -> None:
        """Forget `active` here, having `ended` (its script's terminal state) or not
        (`leave`)."""
        self.leave([(active, ended)], deregister=deregister)

    def leave(self, leaving: list[tuple[ActiveJob, JobState | None]], *,
              deregister: bool = True, later: bool = False) -> None:
        """Forget each job of `leaving`, ``(job, terminal state or None)``, here: a chunk
        launched for it is abandoned, room is made for the next job, it leaves this worker's
        held jobs (unless not `deregister`) and a job that ended is counted, in one round
        trip (`forget_departed`) or, `later`, in the next step's (the scripts of a step's
        round trip end its jobs); then the hooks see it leave (its cache released or kept as
        its session's slot at its last committed chunk; an ended job's checkpoints deleted)."""
        for active, _ in leaving:
            active.prefill.abandon()
            self.scheduler.remove(active.job_id)
        try:
            finished = [active for active, ended in leaving if ended == JobState.FINISHED]
            reused = sum(active.prefill.cached_tokens for active in finished)
            hits, misses = self.prefixes.outcomes(finished) if self.prefixes else (0, 0)
            self.departed.merge(Departures(
                self.name, [active.job_id for active, _ in leaving] if deregister else [],
                Counter(ended for _, ended in leaving if ended), reused, hits, misses))
            if not later:
                self.forget_departed()
        finally:
            for active, ended in leaving:
                for hook in self.hooks:
                    hook.leaving(active, ended)

    def forget_departed(self) -> None:
        """Forget the jobs that left and are not forgotten yet (`Departures.send`) in a round
        trip of their own: before a worker idles or stops, or where a job leaves outside a
        step. On a Redis error they are kept for the next round trip."""
        with self.departed.taken() as departed:
            departed.send(self.connection, self.active)

    # -- writes Redis refused -------------------------------------------------------------

    def _refused(self, job_id: str, error: Exception) -> None:
        """A write of `job_id`'s step was refused: fail a resident job with `REDIS_OOM`
        (its cache is dropped), or put a job that was not taken back on intake; a write
        that is refused again is parked for `settle`."""
        active = self.active.get(job_id)
        if active is None:  # not taken: back to the head of its intake queue
            self.parked.park(job_id, "re-enqueue",
                             lambda: requeue_to_intake(self.connection, job_id, at_front=True),
                             error)
            return
        self.drop(active, deregister=False)
        message = (f"Redis refused a write of this job under its maxmemory/noeviction policy "
                   f"or size limit: {error}")
        fence = self._fence(active)
        self.parked.park(job_id, "failure", lambda: self.fail(job_id, fence, REDIS_OOM, message),
                   error)

    def settle(self) -> int:
        """Retry the transitions Redis refused earlier (`ParkedWrites.settle`)."""
        return self.parked.settle()
