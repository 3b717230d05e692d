"""`PrefillWorker`: an RQ SimpleWorker that advances prefill jobs one bounded chunk at a time."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import uuid
from contextlib import suppress

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq import Queue, SimpleWorker
from rq.job import Job
from rq.timeouts import BaseDeathPenalty
from rq.worker import WorkerStatus

from jobs.client import redacted
from jobs.defaults import DEFAULT_MAX_ACTIVE
from jobs.errors import JobRefused
from jobs.queues import AdmissionJob, intake_queue, move_to_intake, own_queue, refusal
from jobs.serializer import MsgpackSerializer
from model.registry import LoadedModel

from .active import ActiveJob
from .checkpoints.checkpointing import Checkpointing
from .checkpoints.policy import CheckpointPolicy
from .checkpoints.store import open_store
from .connection import (
    RedisUnreachable,
    gave_up,
    give_up_after,
    refused_write,
    unless_refused,
    until_accepted,
)
from .faults import FaultPlan
from .heartbeat import Heartbeat
from .scheduler import Admit, Idle, Run, Scheduler
from .sessions import SessionSlots
from .settings import WorkerSettings
from .step import Stepper
from .taking import TakingQueue, taken, taken_in_bulk

log = logging.getLogger("prefillq.worker")

__all__ = ["DEFAULT_MAX_ACTIVE", "ActiveJob", "PrefillWorker", "current_worker"]

REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError)
PUBSUB_STOP_S = 5.0  # seconds `unsubscribe` waits for RQ's pubsub thread once told to end
# an idle worker's wait on intake (s, RQ's whole-second BLPOP): each tenant is an intake
# queue of its own, so a new tenant's first job waits at most this on idle workers
IDLE_WAIT_S = 1


class NoDeathPenalty(BaseDeathPenalty):
    """Chunks are never interrupted: an exception thrown into MLX work would leave the cache
    half written. A chunk is bounded by its token count instead of a timer."""

    def setup_death_penalty(self) -> None:
        pass

    def cancel_death_penalty(self) -> None:
        pass


_current = threading.local()


def current_worker() -> PrefillWorker:
    """The worker executing the current RQ job (set around each execution)."""
    worker = getattr(_current, "worker", None)
    if worker is None:
        raise RuntimeError("advance_prefill runs only inside a PrefillWorker")
    return worker


def default_worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class PrefillWorker(SimpleWorker):
    """Serves the models in `models` from their intake queues.

    The model and every admitted job's KV cache live in this process across steps, so jobs
    run in the worker's own process (RQ's `SimpleWorker`,
    https://python-rq.org/docs/workers/). This class holds the RQ hooks: which queues are
    read and when (`worker.scheduler`), which RQ jobs may run (`jobs.queues.refusal`: only
    `jobs.queues.ADMIT_FUNCTION` with one job id, no callbacks or webhooks), start and
    shutdown. The chunk step is `worker.step`, liveness `worker.heartbeat`, the Redis retry
    policy `worker.connection`. A warm shutdown (SIGTERM or SIGINT, RQ's ``request_stop``)
    hands every resident job back to intake; when Redis stays unreachable for
    ``heartbeat_ttl_s`` after the signal, `work` raises `RedisUnreachable` instead (the
    reaper requeues what was not handed back).

    Args:
        models: loaded models by registry name.
        connection: Redis connection (bytes responses); `worker.connection.worker_connection`
            gives one that rides out outages.
        settings: how it serves (`WorkerSettings`; default: every default).
        name: worker name (also names its own queue); default host-pid-random.
    Raises:
        ValueError: no models, a bad ``settings.checkpoint_store`` or
            ``settings.checkpoint_every``, or a ``$PREFILLQ_FAULTS`` that does not parse
            (`worker.faults`: fault injection, for tests only).
    """

    death_penalty_class = NoDeathPenalty
    job_class = AdmissionJob  # runs only the allow-listed job function (`jobs.queues.refusal`)

    def __init__(self, models: dict[str, LoadedModel], connection,
                 settings: WorkerSettings | None = None, *, name: str | None = None):
        if not models:
            raise ValueError("a worker needs at least one model")
        settings = settings or WorkerSettings()
        name = name or default_worker_name()
        self.models, self.settings = models, settings
        self.heartbeat_ttl_s = max(1, settings.heartbeat_ttl_s)
        self.own_queue = own_queue(connection, name)
        intake = [intake_queue(connection, m) for m in models]
        super().__init__([self.own_queue, *intake], connection=connection, name=name,
                         serializer=MsgpackSerializer)
        self.queue_class = TakingQueue.for_worker(name, connection)  # pops kept for the reaper
        # (named apart from RQ's own `scheduler`, its scheduler of RQ jobs for later); the
        # priorities in use are re-read as often as the worker beats (a few per TTL)
        self.prefill_scheduler = Scheduler.of(connection, list(models), self.own_queue,
                                              settings, self.heartbeat_ttl_s / 6, name)
        every, store = settings.checkpoint_every, settings.checkpoint_store
        policy = CheckpointPolicy.parse(every or "none")
        self._checkpoints_line = ("KV checkpoints: off" if policy is None else
                                  f"KV checkpoints: every {every} to "
                                  f"{redacted(store or 'the queue Redis')}")
        self.checkpointing = None if policy is None else Checkpointing(
            connection, name, open_store(store, connection), policy,
            ttl_s=settings.result_ttl_s, max_bytes=settings.checkpoint_max_bytes)
        self.sessions = SessionSlots(
            connection, name, max_slots=settings.session_slots,
            max_bytes=settings.session_bytes,
            checkpoints=self.checkpointing.sessions if self.checkpointing else None)
        self.stepper = Stepper(connection, name, models, self.prefill_scheduler, settings,
                               sessions=self.sessions, checkpointing=self.checkpointing,
                               faults=FaultPlan.from_env())
        self.prefixes = self.stepper.prefixes
        self._rq_beat_at, self._swept_at = 0.0, time.monotonic()
        self.liveness = Heartbeat(connection, name, models, ttl_s=self.heartbeat_ttl_s,
                                  result_ttl_s=settings.result_ttl_s, on_beat=self._on_beat,
                                  publish_tokenizers=settings.publish_tokenizers)
        self._stop_signal = "SIGTERM"

    def _on_beat(self) -> None:  # the maintenance thread's: parked writes, old checkpoints
        self.stepper.settle()
        if self.checkpointing is not None and time.monotonic() >= self._swept_at + 60:
            self._swept_at = time.monotonic()
            self.checkpointing.store.sweep()

    @property
    def active(self) -> dict[str, ActiveJob]:
        """The jobs whose KV caches this worker holds, by job id."""
        return self.prefill_scheduler.resident

    def register_models(self) -> None:
        """Advertise this worker's models (vocab, context) so clients can validate submits."""
        self.liveness.register_models()

    def advance(self, job_id: str) -> None:
        """Admit `job_id` (the body of ``advance_prefill``); its chunks run in the steps."""
        self.stepper.admit([job_id])

    def hand_back_active(self) -> None:
        """Requeue every resident job to intake (warm shutdown)."""
        self.stepper.hand_back_active()

    # -- RQ hooks -----------------------------------------------------------------------

    def bootstrap(self, *args, **kwargs) -> None:
        # Nothing of this worker is in Redis yet, so while Redis refuses writes (maxmemory)
        # it waits, as for an outage, and beats only once registered: no heartbeat to keep.
        super().bootstrap(*args, **kwargs)
        log.info("%s; %s", self._checkpoints_line,
                 self.prefill_scheduler.fair.describe(self.settings.tenant_max_resident))
        until_accepted(self.connection, self.register_models,
                       f"the registration of {self.name}'s models")
        self.liveness.start()

    def register_birth(self) -> None:
        """RQ's registration of this worker, retried while Redis refuses it (`until_accepted`)."""
        until_accepted(self.connection, super().register_birth,
                       f"the registration of {self.name} with RQ")

    def set_state(self, state: str, pipeline=None) -> None:
        """RQ's record of the worker's state (`rq.worker.WorkerStatus`)."""
        if state != WorkerStatus.STARTED:
            super().set_state(state, pipeline)
        else:  # written once at start and replaced by the next state: skipped if refused
            unless_refused("RQ's STARTED state", super().set_state, state, pipeline)

    def dequeue_job_and_maintain_ttl(self, timeout, max_idle_time=None):
        # RQ asks for its next execution; none is returned. Waiting jobs are admitted in bulk,
        # a step of resident jobs runs here, an idle worker blocks as RQ does and admits the
        # job that woke it the same way; a refused write (maxmemory) waits for room.
        while True:
            self.stepper.settle()
            if self._stop_requested:
                return None
            decision = self.prefill_scheduler.schedule()
            if isinstance(decision, Admit):
                if not self._admit(decision.queues, decision.caps):
                    self.prefill_scheduler.saw_intake(False)  # until a round trip sees one
                continue
            if isinstance(decision, Run):
                if self.get_state() != WorkerStatus.BUSY:  # a SIGTERM now waits for the chunk
                    self.set_state(WorkerStatus.BUSY)
                self.stepper.run(decision.step)
                self._maintain()
                continue
            assert isinstance(decision, Idle)
            try:
                self.stepper.forget_departed()  # the last steps' ended jobs, before a wait
                woken = self._block_on_intake(timeout, max_idle_time)
                self.prefill_scheduler.saw_intake(woken is not None)  # more may wait
                if woken is None:
                    return None
                self._start_popped([woken])
            except Exception as error:
                if not refused_write(error):
                    raise
                log.warning("Redis refused a write while dequeuing (%s); waiting", error)
                time.sleep(self.heartbeat_ttl_s / 6)

    def _block_on_intake(self, timeout, max_idle_time):
        """RQ's blocking dequeue (a single look in burst mode, `timeout` None), in waits of
        `IDLE_WAIT_S` after each of which the intake levels in use are read again, so a job
        of a priority or a tenant no queue had before is seen within one wait."""
        idle_until = None if max_idle_time is None else time.monotonic() + max_idle_time
        while True:
            self._ordered_queues = self.prefill_scheduler.idle_queues()
            if timeout is None:
                return super().dequeue_job_and_maintain_ttl(None, max_idle_time)
            result = super().dequeue_job_and_maintain_ttl(IDLE_WAIT_S, IDLE_WAIT_S)
            if result is not None or self._stop_requested:
                return result
            if idle_until is not None and time.monotonic() >= idle_until:
                return None

    def _admit(self, queues: list[Queue], caps: list[int] | None = None) -> bool:
        """Admit as many jobs waiting in `queues` as there is room for (and `caps` allow,
        `Admit.caps`), in order, in a few round trips whatever their number
        (`TakingQueue.take`, `_start_popped`); returns whether any was waiting."""
        popped = self.queue_class.take(
            queues, self.prefill_scheduler.room(), connection=self.connection,
            job_class=self.job_class, serializer=self.serializer,
            expire_s=self.settings.result_ttl_s, caps=caps)
        if not popped:
            return False
        self._start_popped(popped)
        return True

    def _start_popped(self, popped: list[tuple[Job, Queue]]) -> None:
        """Start the RQ jobs `popped` (their pops recorded for the reaper until now): each is
        checked as RQ's execution would be (`jobs.queues.refusal`: a refused one goes to
        RQ's failed registry), the rest are admitted together (`Stepper.admit`) instead of
        one RQ execution each, and every pop is then forgotten."""
        admitted = []
        for job, queue in popped:
            reason = refusal(job)
            if reason is not None:
                self.refuse(job, queue, reason)
            else:
                admitted.append(job)
        try:
            self.stepper.admit([job.args[0] for job in admitted])
        finally:
            taken_in_bulk(self.connection, self.name, [job for job, _ in popped],
                          done=admitted)

    def _maintain(self) -> None:
        """RQ's worker heartbeat and maintenance, run between chunks."""
        self.heartbeat()
        if self.should_run_maintenance_tasks:
            self.run_maintenance_tasks()

    def execute_job(self, job: Job, queue: Queue) -> None:
        try:
            self._execute(job, queue)
        finally:  # the job is held, put back or not runnable: no longer the reaper's
            taken(self.connection, self.name, job.id)

    def _execute(self, job: Job, queue: Queue) -> None:
        reason = refusal(job)
        if reason is not None:
            self.refuse(job, queue, reason)
            return
        _current.worker = self
        try:
            super().execute_job(job, queue)
        except Exception as error:  # RQ's bookkeeping of the execution, not the job's step
            if not refused_write(error):
                raise
            log.warning("Redis refused RQ's bookkeeping of %s: %s", job.id, error)
        finally:
            _current.worker = None

    def refuse(self, job: Job, queue: Queue, reason: str) -> None:
        """Record RQ job `job` failed, with ``JobRefused: reason``, without running any of
        it (its function, callbacks, webhooks) and without retrying it."""
        log.error("refused RQ job %r from %s: %s", job.id, queue.name, reason)
        job.retries_left = None
        self.handle_job_failure(job, queue, exc_string=f"{JobRefused.__name__}: {reason}")

    # RQ's own liveness and housekeeping writes: one Redis refuses is skipped this turn
    def heartbeat(self, timeout: int | None = None, pipeline=None):
        """RQ's worker heartbeat (three round trips), at most every sixth of its TTL unless
        RQ names a timeout or a pipeline (its dequeue beats twice for each job that wakes it)."""
        if timeout is None and pipeline is None and time.monotonic() < self._rq_beat_at:
            return
        self._rq_beat_at = time.monotonic() + self.worker_ttl / 6
        unless_refused("RQ's worker heartbeat", super().heartbeat, timeout, pipeline)

    def run_maintenance_tasks(self):
        unless_refused("RQ's maintenance", super().run_maintenance_tasks)

    def check_for_suspension(self, burst: bool):
        unless_refused("RQ's suspension check", super().check_for_suspension, burst)

    def request_stop(self, signum, frame):
        # From now on a Redis that stays unreachable for one heartbeat TTL ends the worker.
        give_up_after(self.connection, self.heartbeat_ttl_s)
        self._stop_signal = signal.Signals(signum).name
        try:
            super().request_stop(signum, frame)
        except REDIS_ERRORS:  # RQ could not record the request: stop after this execution
            self._stop_requested = True

    def teardown(self) -> None:
        self.hand_back_active()
        self.stepper.settle()
        with suppress(*REDIS_ERRORS):  # an ended job left held is a no-op for the reaper
            self.stepper.forget_departed()
        if self.checkpointing is not None:  # a hand-back's last checkpoint has landed
            self.checkpointing.flush(timeout=30)
        try:  # jobs routed here go to intake (routing to this worker ends with its heartbeat)
            move_to_intake(self.connection, self.name)
        except Exception:
            log.warning("could not move %s's own queue to intake", self.name, exc_info=True)
        self.liveness.stop()
        try:
            self.liveness.deregister()
        except Exception:
            log.warning("could not deregister %s", self.name, exc_info=True)
        try:
            super().teardown()
        except Exception as error:
            if not refused_write(error) and gave_up(self.connection) is None:
                raise
            log.warning("could not record %s's death in RQ: %s", self.name, error)

    def unsubscribe(self) -> None:
        """RQ's end of its pubsub thread (RQ's command channel), in an order that cannot hang:
        run flag cleared, UNSUBSCRIBE (its reply ends the thread's read), join for at most
        `PUBSUB_STOP_S`. RQ 3.0 unsubscribes, then calls ``stop()``, which since redis-py 8.2
        waits for the thread, which, unsubscribed, waits in ``get_message`` for RQ's 60 s
        ``sleep_time``: a SIGTERM'd worker took a minute to exit half the time
        (`tests/bench/test_serve.py`)."""
        thread = self.pubsub_thread
        if not thread:
            return
        log.info("%s: unsubscribing from channel %s", self.name, self.pubsub_channel_name)
        try:
            thread.stop(timeout=0)  # redis-py >= 8.2: clears the run flag, waits 0 s
        except TypeError:
            thread.stop()  # older redis-py: stop() only clears the flag
        self.pubsub.unsubscribe()
        thread.join(timeout=PUBSUB_STOP_S)
        self.pubsub.close()

    def work(self, *args, **kwargs) -> bool:
        """RQ's work loop (see `rq.worker.BaseWorker.work`).

        Raises:
            RedisUnreachable: Redis stayed unreachable for ``heartbeat_ttl_s`` after a stop
                request, so resident jobs may not have been handed back.
        """
        try:
            worked = super().work(*args, **kwargs)
        except REDIS_ERRORS:
            if gave_up(self.connection) is None:
                raise
            worked = False
        waited = gave_up(self.connection)
        if waited is not None:
            left = len(self.active) + len(self.stepper.parked)
            raise RedisUnreachable(
                f"Redis unreachable for {waited:g} s after {self._stop_signal}; exiting "
                f"without handing "
                f"back {left} job{'' if left == 1 else 's'} (the reaper will requeue them)"
            )
        return worked
