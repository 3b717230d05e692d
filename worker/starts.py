"""`Starts`: how a worker's `Stepper` takes jobs (``queued -> prefilling``), several at once."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from jobs import keys, scripts
from jobs.record import JobRecord, encode_field
from jobs.schema import JobState, now
from jobs.scripts import Fence, StartCounts
from model.registry import LoadedModel

from .active import ActiveJob
from .connection import refused_write
from .intake import not_served, read_records
from .prepare import Prepared, prepare
from .roundtrip import run_scripts

log = logging.getLogger("prefillq.worker")


@dataclass
class _Start:
    """A job about to be taken: its record, model (None: it fails) and what `prepare` made."""

    record: JobRecord
    loaded: LoadedModel | None
    prepared: Prepared


class Starts:
    """The start of jobs on a worker: a mixin of `worker.step.Stepper`, whose connection,
    scripts, scheduler, settings, hooks and transitions (`fail`, `_refused`) it uses."""

    def start(self, job_ids: list[str]) -> list[ActiveJob]:
        """First execution of jobs here: tokenize, validate, plan (`worker.prepare`), check
        the KV budget, then take them (``queued -> prefilling``), in three round trips
        whatever their number: their records read, their START scripts, their registration
        as held here. Returns the jobs started; the others are not ours to run (gone, another
        model, not queued, failed their input checks, wait for room or for the prefix a job
        here is prefilling, or a record that does not decode: failed with ``CorruptJob``,
        `worker.intake.read_records`), and a session slot one checked out is kept again
        then."""
        starting, waiting, deferred = [], [], []
        room = self.scheduler.kv_room()
        wave: set[str] = set()  # the jobs starting with these

        def live(job_id: str) -> bool:
            return job_id in self.active or job_id in wave

        for record in read_records(self.connection, self.scripts, job_ids, self.result_ttl_s):
            if waiting:  # one did not fit: those behind it wait too, in order
                waiting.append(record)
                continue
            start = self._prepare(record, live)
            if start is None:
                continue
            if start.prepared.deferred:
                deferred.append(record)
                continue
            prefill = start.prepared.prefill
            nbytes = prefill.cache.nbytes if prefill is not None else 0
            alone = not self.active and not starting  # a job alone fits whatever its size
            if room is not None and nbytes > room and not alone:
                self._keep_slot(record, start.prepared)
                waiting.append(record)
                continue
            starting.append(start)
            wave.add(record.job_id)
            room = None if room is None else room - nbytes
        for record in reversed(waiting):  # each to the head of its queue, in their order
            self.scheduler.wait_for_room(record)
        started = self._take(starting) if starting else []
        for record in reversed(deferred):
            self.scheduler.wait_for_prefix(record)
        return started

    def _prepare(self, record: JobRecord, live: Callable[[str], bool]) -> _Start | None:
        job_id = record.job_id
        if record.state != JobState.QUEUED:  # a stray execution (the reaper's, a re-enqueue)
            log.info("job %s is %s; not starting it", job_id, record.state.value)
            return None
        loaded = self.models.get(record.model)  # by name only: nothing is loaded for a job
        if loaded is None:  # back to its model's intake, or failed with UnknownModel
            error = not_served(self.connection, record)
            return None if error is None else _Start(
                record, None, Prepared(None, (type(error).__name__, str(error))))
        return _Start(record, loaded, prepare(
            loaded, record, chunk_tokens=self.chunk_tokens, sessions=self.sessions,
            checkpointing=self.checkpointing, limits=self.limits, prefixes=self.prefixes,
            live=live))

    def _take(self, starting: list[_Start]) -> list[ActiveJob]:
        calls = []
        for start in starting:
            prefill = start.prepared.prefill
            plan, counts = b"", None
            if prefill is not None:
                if start.prepared.slot is None:  # a session job plans afresh at every start
                    plan = encode_field("chunk_plan", list(prefill.plan.boundaries))
                counts = StartCounts(prefill.n_tokens, prefill.plan.recovery_position,
                                     prefill.cursor, prefill.cached_tokens, prefill.reuse,
                                     prefill.resumed_from)
            if self.faults is not None:
                self.faults.pause("before_start", start.record.job_id,
                                  len(prefill.token_ids) if prefill else 0,
                                  start.record.attempts + 1)
            calls.append(scripts.start(start.record.job_id, worker=self.name, now=now(),
                                       token=uuid.uuid4().hex, chunk_plan=plan,
                                       counts=counts))
        reply = run_scripts(self.connection, self.scripts, calls)
        started = []
        for start, outcome in zip(starting, reply.outcomes, strict=True):
            job_id = start.record.job_id
            if isinstance(outcome, Exception):
                self._keep_slot(start.record, start.prepared)
                if not refused_write(outcome):
                    raise outcome
                self._refused(job_id, outcome)
            elif outcome[0] != b"started":
                log.info("job %s is %s; not starting it", job_id, outcome[0].decode())
                self._keep_slot(start.record, start.prepared)
            elif start.prepared.error is not None:
                self._guarded(job_id, self.fail, job_id, Fence(self.name, int(outcome[1])),
                              *start.prepared.error)
            else:
                started.append((self._activate(start, int(outcome[1])), start.record))
        self._register(started)
        return [active for active, _ in started if active.job_id in self.active]

    def _keep_slot(self, record: JobRecord, prepared: Prepared) -> None:
        """Undo what a prepared job that is not taken holds: its session's slot is kept
        again, its prefix captures are dropped."""
        if prepared.slot is not None:
            self.sessions.keep(record.session, record.model, prepared.slot)
        if self.prefixes is not None:
            self.prefixes.release(record.job_id, prepared.prefix_keys)

    def _activate(self, start: _Start, attempt: int) -> ActiveJob:
        record, prepared, started = start.record, start.prepared, now()
        active = ActiveJob(
            job_id=record.job_id,
            attempt=attempt,
            max_attempts=record.max_attempts,
            model=start.loaded,
            prefill=prepared.prefill,
            top_k=record.top_k,
            logits_mode=record.logits_mode,
            enqueued_at=record.enqueued_at or started,
            first_started_at=record.first_started_at or started,
            started_at=started,
            session=record.session if prepared.slot is not None else None,
            tenant=record.tenant,
            slot=prepared.slot,
            checkpoints=prepared.checkpoints,
            prefix_keys=prepared.prefix_keys,
            continuations=prepared.continuations,
            label_token_ids=record.label_token_ids,
        )
        if self.faults is not None:
            self.faults.install(active)
        self.scheduler.add(active)
        return active

    def _register(self, started: list[tuple[ActiveJob, JobRecord]]) -> None:
        """Record the `started` jobs as held here (the reaper's list), then tell the hooks;
        a registration Redis refuses fails them (`_refused`)."""
        if not started:
            return
        try:
            self.connection.sadd(keys.worker_jobs(self.name), *[a.job_id for a, _ in started])
        except Exception as error:
            if not refused_write(error):
                raise
            for active, _ in started:
                self._refused(active.job_id, error)
            return
        for active, record in started:
            for hook in self.hooks:
                hook.started(active, record)
