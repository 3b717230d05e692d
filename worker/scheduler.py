"""The scheduler: the one owner of which resident job runs next and when a new one is admitted.

Its `schedule` is the worker loop's only decision, as ``Scheduler.schedule`` is vLLM's: admit
a waiting job, run a step of resident jobs, or block on intake while nothing is resident.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

from redis.exceptions import RedisError
from rq import Queue

from jobs import keys
from jobs.defaults import DEFAULT_MAX_ACTIVE, DEFAULT_MAX_BATCH_JOBS
from jobs.queues import enqueue_admission, intake_levels_of, intake_queue
from jobs.record import JobRecord

from .active import ActiveJob
from .fair_share import FairShare, admission_caps, decode_weights, tenant_of
from .roundtrip import Probe, Reply
from .settings import WorkerSettings

log = logging.getLogger("prefillq.worker")


@dataclass(frozen=True)
class Step:
    """The resident jobs one step advances, a chunk each, in turn order."""

    jobs: tuple[ActiveJob, ...]

    @property
    def tokens(self) -> int:
        """Tokens the step's chunks compute."""
        return sum(a.prefill.next_chunk_tokens for a in self.jobs)


@dataclass(frozen=True)
class Admit:
    """Take waiting jobs from `queues` in order (own queue first, then intake by priority),
    at most `caps[i]` from ``queues[i]`` (None: no cap but the room); their first chunks run
    in the next step."""

    queues: list[Queue]
    caps: list[int] | None = None


@dataclass(frozen=True)
class Run:
    """Run `step` now."""

    step: Step


@dataclass(frozen=True)
class Idle:
    """No resident job has a chunk to run: block on intake (`Scheduler.idle_queues`)."""


Decision = Admit | Run | Idle


class Scheduler:
    """One worker's resident jobs, their turn order, and its admission policy.

    Resident jobs take turns round-robin, one chunk each; a step takes the jobs whose turn
    it is, in turn order, up to `max_batch_jobs` of them and `step_tokens` tokens (the
    first always, whatever its chunk's size), and each moves to the back of the order, so
    every resident job runs within ``ceil(resident / max_batch_jobs)`` steps. With tenants
    (`worker.fair_share`), a step fills from the tenant with the least virtual service
    first (round robin within a tenant), and intake queues are admitted from in the same
    order, each tenant's by priority. While fewer
    than `max_active` are resident and their KV bytes are under `kv_budget_bytes`, jobs
    waiting in the worker's own queue or an intake queue (highest priority first) are
    admitted between any two steps, one after another while room lasts and a queue holds
    one, as soon as a step's round trip saw one waiting (`saw_intake`). An admitted job's
    first turn comes before every job that has run a chunk here (after those admitted
    before it), so a new job waits at most for the step in progress, and the jobs admitted
    together share their first step. A job that does not fit goes back to the head of its
    intake queue, and nothing is admitted until a resident job leaves.

    Args:
        connection: Redis connection.
        models: names of the served models.
        own: the worker's own queue (jobs routed to it: sessions it holds).
        max_active: jobs resident at once (at least 1).
        kv_budget_bytes: no new job is admitted while resident KV bytes exceed this
            (``ActiveJob.prefill.cache.nbytes``); None for no bound.
        refresh_s: while jobs are resident, a new priority level's intake queue is read
            within this many seconds of its first job.
        max_batch_jobs: jobs one step advances at most (at least 1).
        step_tokens: tokens one step computes at most, over its jobs' chunks (None: no
            bound beyond `max_batch_jobs`).
        tenant_weights: tenant -> weight in the fair share, until ``keys.TENANT_WEIGHTS``
            is read (an operator's edits there win).
        tenant_max_resident: jobs of one tenant resident here at most (None: no quota).
        name: the worker's, whose jobs by tenant it writes (``keys.worker_tenants``).

    Raises:
        ValueError: `step_tokens` is not positive.
    """

    def __init__(self, connection, models: list[str], own: Queue, *,
                 max_active: int = DEFAULT_MAX_ACTIVE, kv_budget_bytes: int | None = None,
                 refresh_s: float = 1.0, max_batch_jobs: int = DEFAULT_MAX_BATCH_JOBS,
                 step_tokens: int | None = None, tenant_weights: dict | None = None,
                 tenant_max_resident: int | None = None, name: str = ""):
        if step_tokens is not None and step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {step_tokens}")
        self.connection, self.models, self.own = connection, list(models), own
        self.max_batch_jobs, self.step_tokens = max(1, max_batch_jobs), step_tokens
        self.max_active = max(1, max_active)
        self.kv_budget_bytes = kv_budget_bytes
        self.refresh_s = refresh_s
        # the jobs whose KV caches this worker holds, by id, in turn order (next first)
        self.resident: OrderedDict[str, ActiveJob] = OrderedDict()
        self.fresh: set[str] = set()  # admitted, no chunk run yet: at the head of the order
        self.intake_waiting = True  # as of the last round trip: a queue to admit from holds one
        self.room_needed = False  # a job waits for KV room: admit nothing until one leaves
        self.fair = FairShare(tenant_weights)
        self.tenant_max_resident = tenant_max_resident
        self.name = name
        self._sent_held: dict[str, int] | None = None  # as keys.worker_tenants(name) holds
        # the intake levels in use, (priority, tenant, model) each, as last read
        self._levels: list[tuple[int, str | None, str]] | None = None
        self._level_counts: list[int] | None = None  # tenants' levels per model, as read
        self._intake_read_at = 0.0

    @classmethod
    def of(cls, connection, models: list[str], own: Queue, settings: WorkerSettings,
           refresh_s: float = 1.0, name: str = "") -> Scheduler:
        """The scheduler of worker `name` with `settings` (its admission and step
        options)."""
        return cls(connection, models, own, max_active=settings.max_active,
                   kv_budget_bytes=settings.kv_budget_bytes, refresh_s=refresh_s,
                   max_batch_jobs=settings.max_batch_jobs, step_tokens=settings.step_tokens,
                   tenant_weights=settings.tenant_weights,
                   tenant_max_resident=settings.tenant_max_resident, name=name)

    # -- the decision -------------------------------------------------------------------

    def schedule(self) -> Decision:
        """What the worker does next: `Admit` while a job waits and there is room (checked
        again at every decision, so a job waits at most one step; the worker reports an
        empty look with `saw_intake`), else `Run` the next step (its jobs move to the back
        of the turn order), else `Idle`."""
        if self.intake_waiting:
            admit = self.admission()
            if admit.queues:
                return admit
        step = self.next_step()
        if step is None:
            return Idle()
        return Run(self._take(step))

    def next_step(self) -> Step | None:
        """The step whose turn it is, without taking the turn (None: no resident job has a
        chunk left; one whose last chunk ran is resident until its publish is recorded)."""
        by_tenant: dict[str, list[ActiveJob]] = {}  # runnable jobs, each in turn order
        for active in self.resident.values():
            if active.prefill.next_chunk_tokens:
                by_tenant.setdefault(tenant_of(active.tenant), []).append(active)
        service = {t: self.fair.of(t) for t in by_tenant}
        jobs: list[ActiveJob] = []
        tokens = 0
        while by_tenant:
            # the least served tenant; equals by whose next job's turn comes first
            tenant = min(by_tenant, key=lambda t: service[t])
            active = by_tenant[tenant][0]
            n = active.prefill.next_chunk_tokens
            full = len(jobs) == self.max_batch_jobs or (
                self.step_tokens is not None and tokens + n > self.step_tokens)
            if jobs and full:
                break
            jobs.append(active)
            tokens += n
            service[tenant] += n / self.fair.weight(tenant)
            del by_tenant[tenant][0]
            if not by_tenant[tenant]:
                del by_tenant[tenant]
        return Step(tuple(jobs)) if jobs else None

    def take_turn(self) -> Step:
        """The step whose turn it is; its jobs' next turns come after the other jobs'.

        Raises:
            LookupError: nothing is resident.
        """
        step = self.next_step()
        if step is None:
            raise LookupError("no resident job to step")
        return self._take(step)

    def _take(self, step: Step) -> Step:
        for active in step.jobs:
            self.resident.move_to_end(active.job_id)
            self.fresh.discard(active.job_id)
            self.fair.charge(tenant_of(active.tenant), active.prefill.next_chunk_tokens)
        return step

    def saw_intake(self, waiting: bool) -> None:
        """Whether a queue to admit from holds a job, as a step's round trip read the lengths
        of `queue_keys` or an admission's look found it."""
        self.intake_waiting = waiting

    def probe(self, others: list[str], leaving: bool = False,
              chunks: list[tuple[float, int]] | None = None) -> Probe:
        """What a step's round trip reads and writes beside its scripts: `others`' cancel
        flags, the admission queues' lengths (`queue_keys` of `leaving`), the `chunks`'
        stats, and the tenants' service charged since the last round trip (read back while
        tenants are in play)."""
        tenants = self.fair.enabled
        lifts, charges, tokens = self.fair.take_pending()
        held = self.held() if tenants else None
        if held == self._sent_held:
            held = None
        else:
            self._sent_held = held
        return Probe(others=others, queue_keys=self.queue_keys(leaving), chunks=chunks or (),
                     lifts=lifts, service=charges, tokens=tokens, worker=self.name,
                     held=held, read_service=tenants,
                     set_keys=[keys.tenant_levels(m) for m in self.models] if tenants else ())

    def saw(self, reply: Reply) -> None:
        """What a step's round trip (`probe`) brought back: whether intake holds a job, the
        cluster's tenant service, and how many tenants' intake levels each model has (a
        new one is read before the next admission)."""
        self.saw_intake(reply.intake_waiting)
        if reply.service is not None:
            self.fair.observe(reply.service)
        if reply.set_sizes is not None and reply.set_sizes != self._level_counts:
            self._levels = None
            self.intake_waiting = True  # look at the new level's queue

    # -- the resident jobs --------------------------------------------------------------

    def add(self, active: ActiveJob) -> None:
        """`active` is resident now; its first turn comes after the other jobs admitted and
        not yet stepped, before the jobs that have run a chunk. A tenant with no other job
        resident here is lifted to the least service among those with one (`FairShare.lift`)."""
        tenant = tenant_of(active.tenant)
        others = {tenant_of(a.tenant) for a in self.resident.values()}
        self.fair.seen(tenant)
        if tenant not in others:
            self.fair.lift(tenant, others)
        self.resident[active.job_id] = active
        for job_id in [j for j in self.resident if j not in self.fresh and j != active.job_id]:
            self.resident.move_to_end(job_id)
        self.fresh.add(active.job_id)

    def remove(self, job_id: str) -> ActiveJob | None:
        """`job_id` left this worker (None if it was not resident); its room is free. The
        last job out clears ``keys.worker_tenants`` (no round trip follows on an idle
        worker; best effort)."""
        self.room_needed = False
        self.fresh.discard(job_id)
        active = self.resident.pop(job_id, None)
        if not self.resident and self._sent_held:
            with contextlib.suppress(RedisError):
                self.connection.delete(keys.worker_tenants(self.name))
                self._sent_held = {}
        return active

    @property
    def resident_kv_bytes(self) -> int:
        """KV cache bytes of every resident job."""
        return sum(a.prefill.cache.nbytes for a in self.resident.values())

    # -- admission ----------------------------------------------------------------------

    def admitting(self) -> bool:
        """Whether a new job may be taken now."""
        if len(self.resident) >= self.max_active or self.room_needed:
            return False
        return self.kv_budget_bytes is None or self.resident_kv_bytes < self.kv_budget_bytes

    def extra_slot(self) -> bool:
        """Whether a tenant with no job resident here may take a slot beyond `max_active`
        now: while tenants are in play, fewer than twice `max_active` jobs are resident, no
        job waits for KV room and the KV budget has room. So a tenant that arrives while
        another holds every slot starts within a step or two, not when a long job finishes;
        the cost is at most one extra job's cache per such tenant."""
        if not self.fair.enabled or self.room_needed or len(self.resident) >= 2 * self.max_active:
            return False
        return self.kv_budget_bytes is None or self.resident_kv_bytes < self.kv_budget_bytes

    def queues(self, leaving: bool = False) -> list[Queue]:
        """The queues to admit from now, in order: the own queue first, then intake, the
        least served tenant first (`worker.fair_share`), each tenant's by priority. While
        there is no room (unless `leaving`: a resident job leaves before the next decision,
        so there will be), only the intake queues of tenants with no job resident here,
        when `extra_slot`, else none. The intake levels in use are read from Redis at most
        every ``refresh_s`` seconds, and after `idle_queues`."""
        return [queue for queue, _ in self._ordered(leaving)]

    def admission(self) -> Admit:
        """`queues` and, under ``tenant_max_resident``, how many jobs to take at most from
        each (`worker.fair_share.admission_caps`: None without a quota)."""
        ordered = self._ordered()
        caps = None if self.tenant_max_resident is None else admission_caps(
            [tenant for _, tenant in ordered], self.held(), self.tenant_max_resident,
            self.room())
        return Admit([queue for queue, _ in ordered], caps)

    def _ordered(self, leaving: bool = False) -> list[tuple[Queue, str | None]]:
        """`queues` of `leaving`, each with its tenant (None for the own queue)."""
        full = not (leaving or self.admitting())
        if full and not self.extra_slot():
            return []
        if self._levels is None or time.monotonic() >= self._intake_read_at + self.refresh_s:
            self._levels, self._intake_read_at = self._read_levels(), time.monotonic()
        held = self.held()
        quota = self.tenant_max_resident
        levels = [level for level in self._levels
                  if not (full and tenant_of(level[1]) in held)
                  and (quota is None or held.get(tenant_of(level[1]), 0) < quota)]
        # the least served tenant first, its priorities highest first; without tenants, by
        # priority as before
        order = sorted(levels, key=lambda level: (
            *self.fair.rank(tenant_of(level[1])), -level[0], level[2]))
        intake = [(intake_queue(self.connection, m, p, t), tenant_of(t)) for p, t, m in order]
        return intake if full else [(self.own, None), *intake]

    def held(self) -> dict[str, int]:
        """Resident jobs by tenant."""
        return dict(Counter(tenant_of(a.tenant) for a in self.resident.values()))

    def queue_keys(self, leaving: bool = False) -> list[str]:
        """Redis keys of `queues` (of `leaving`), whose lengths ride along with a step's
        round trip: a step that completes a job reads them even on a full worker, so the
        room it frees is filled by the next admission, not by an idle wait on RQ."""
        return [q.key for q in self.queues(leaving)]

    def idle_queues(self) -> list[Queue]:
        """The queues to block on while nothing is resident, with the priorities in use read
        again (a job of a priority no queue had before is seen within one wait)."""
        self._levels = None
        return self.queues() or [self.own]

    def _read_levels(self) -> list[tuple[int, str | None, str]]:
        """Every intake level of the served models, ``(priority, tenant, model)``, and the
        tenants' weights (``keys.TENANT_WEIGHTS``, where an operator edits them), in one
        round trip."""
        with self.connection.pipeline(transaction=False) as pipe:
            for m in self.models:
                pipe.smembers(keys.priorities(m))
                pipe.smembers(keys.tenant_levels(m))
            pipe.hgetall(keys.TENANT_WEIGHTS)
            replies = pipe.execute()
        *sets, weights = replies
        self.fair.weights.update(decode_weights(weights))
        self._level_counts = [len(sets[2 * i + 1]) for i in range(len(self.models))]
        levels = []
        for i, m in enumerate(self.models):
            for p, t in intake_levels_of(m, sets[2 * i], sets[2 * i + 1]):
                levels.append((p, t, m))
                self.fair.seen(tenant_of(t))
        return levels

    def kv_room(self) -> int | None:
        """KV bytes new jobs may take now, under `kv_budget_bytes` (None: no bound). A job
        alone fits whatever its size (else it could never run): the caller lets the first
        job in when nothing is resident."""
        if self.kv_budget_bytes is None:
            return None
        return self.kv_budget_bytes - self.resident_kv_bytes

    def room(self) -> int:
        """Jobs that may be admitted now (by `max_active`; 0 while one waits for KV room;
        1 for an `extra_slot`)."""
        if self.admitting():
            return self.max_active - len(self.resident)
        return int(self.extra_slot())

    def wait_for_prefix(self, record: JobRecord) -> None:
        """Put a job back at the head of its intake queue, untouched, while a resident job
        prefills the prefix it would reuse (`worker.prefixes.PrefixBlocks`): nothing is
        admitted until a resident job leaves, then it is taken again (at once when none is
        resident, which a job that was not taken after all leaves)."""
        self._back_to_intake(record)
        self.room_needed = self.room_needed or bool(self.resident)
        log.info("job %s waits for the prefix a resident job is prefilling", record.job_id)

    def wait_for_room(self, record: JobRecord) -> None:
        """Put a job that does not fit back at the head of its intake queue, untouched, and
        admit nothing until a resident job leaves (`remove`)."""
        self._back_to_intake(record)
        self.room_needed = True
        log.info("job %s waits for KV room (%d bytes resident)", record.job_id,
                 self.resident_kv_bytes)

    def _back_to_intake(self, record: JobRecord) -> None:
        queue = intake_queue(self.connection, record.model, record.priority, record.tenant)
        enqueue_admission(queue, record.job_id, at_front=True)
