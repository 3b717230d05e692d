"""The sans-IO core of both clients: each operation of `PrefillClient` (redis) and
`AsyncPrefillClient` (redis.asyncio) as a plan, a generator that yields the round trips to
send (`Trip`) and is sent their replies, and returns the operation's value or raises its
typed error. A client only sends the trips (`Run` steps a plan), so the two cannot drift.

The pure decoding each plan uses is `jobs.protocol`'s; validation is `jobs.requests`'s.
"""

from __future__ import annotations

import dataclasses
import inspect
import uuid
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any

from . import keys, prefixes, protocol, scripts, stats
from .limits import Limits
from .queues import intake_levels_of, new_admission, rq_queue_key
from .requests import ModelInfo, SubmitRequest, check_against_model
from .schema import JobStatus, now
from .values import name_of


@dataclass(frozen=True)
class Trip:
    """One round trip: `queue` puts its commands on a pipeline (a MULTI when `transaction`;
    `raise_on_error` as ``execute`` takes it), or, with `call` set, one script run on the
    connection itself. The plan is sent the replies, in order (a script's as a 1-list)."""

    queue: Callable[[Any], None] | None = None
    transaction: bool = False
    raise_on_error: bool = True
    call: scripts.Call | None = None


def reads(*commands: tuple) -> Trip:
    """A trip of plain commands, each ``(pipeline method name, *args)``."""

    def queue(pipe) -> None:
        for name, *args in commands:
            getattr(pipe, name)(*args)

    return Trip(queue)


Plan = Generator[Trip, list, Any]


class Run:
    """Steps a plan: `trip` is the next round trip to send (None once the plan returned,
    its `value` then); `settle` (sync) or `asettle` (asyncio) sends it through a client's
    `send` and hands the plan the replies, or the error raised, which the plan may catch."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.value: Any = None
        self.trip: Trip | None = self._step(plan.send, None)

    def _step(self, resume: Callable, reply: Any) -> Trip | None:
        try:
            return resume(reply)
        except StopIteration as done:
            self.value = done.value
            return None

    def settle(self, send: Callable[[Trip], list]) -> None:
        try:
            replies = send(self.trip)
        except Exception as error:  # handed to the plan, which re-raises what it does not own
            self.trip = self._step(self.plan.throw, error)
            return
        self.trip = self._step(self.plan.send, replies)

    async def asettle(self, send: Callable[[Trip], Awaitable[list]]) -> None:
        try:
            replies = await send(self.trip)
        except Exception as error:  # as `settle`
            self.trip = self._step(self.plan.throw, error)
            return
        self.trip = self._step(self.plan.send, replies)


def script_trip(call: scripts.Call) -> Trip:
    """A trip that runs script `call` (its reply is sent as a 1-list)."""
    return Trip(call=call)


# -- models ----------------------------------------------------------------------------

def models() -> Plan:
    """Models registered by workers, by name."""
    (raw,) = yield reads(("hgetall", keys.MODELS))
    return protocol.models_of(raw)


def model(name: str) -> Plan:
    """`name`'s registration (`ModelInfo`). Raises UnknownModel: none, or undecodable."""
    (blob,) = yield reads(("hget", keys.MODELS, name_of("model", name)))
    return (yield from _registered(name, blob))


def _registered(name: str, blob: bytes | None) -> Plan:
    """Model `name`'s registration from its ``keys.MODELS`` entry `blob` (None: none, then
    UnknownModel with the registered names)."""
    if blob is None:
        raise protocol.unknown_model(name, (yield from models()))
    return protocol.model_info(name, blob)


def model_and_prefix_root(name: str) -> Plan:
    """`name`'s registration (`ModelInfo`) and the root key of its prompts' prefix blocks
    where a worker keeps a prefix cache for it (else None), in one round trip.

    Raises:
        UnknownModel: no registration, or one that does not decode.
    """
    blob, root = yield reads(("hget", keys.MODELS, name_of("model", name)),
                             ("hget", keys.PREFIX_ROOTS, name))
    return (yield from _registered(name, blob)), root


def prefix_holder(token_ids: list[int] | None, root: bytes | None,
                  salt: str | None = None) -> Plan:
    """The live worker with room that keeps the longest routed prefix of `token_ids`
    (`jobs.prefixes`: its routing entries under `root` salted with `salt`, then its
    heartbeat and own queue's length), or None: no ids, no root (no worker keeps a prefix
    cache for the model), no entry, a holder that is gone, or one with
    ``prefixes.ROUTE_MAX_WAITING`` jobs waiting for it already."""
    if token_ids is None or root is None:
        return None
    root = prefixes.salted(bytes.fromhex(root.decode()), salt)
    reusable = prefixes.block_keys(token_ids[: len(token_ids) - 1], root)
    routed = [reusable[i] for i in prefixes.route_blocks(len(reusable))]
    if not routed:
        return None
    holders = yield reads(*(("get", keys.prefix_route(key)) for key in routed))
    holder = next((h for h in reversed(holders) if h is not None), None)
    alive, waiting = False, 0
    if holder is not None:
        alive, waiting = yield reads(
            ("exists", keys.worker_heartbeat(holder.decode())),
            ("llen", rq_queue_key(keys.own_queue(holder.decode()))))
    return protocol.live_holder(holder, bool(alive) and waiting < prefixes.ROUTE_MAX_WAITING)


def tokenizer_blob(info: ModelInfo) -> Plan:
    """GET of `info`'s published tokenizer (None: not published)."""
    (blob,) = yield reads(("get", keys.tokenizer(info.sha256)))
    return blob


# -- submit ----------------------------------------------------------------------------

def intake_depth(model_name: str, tenant: str | None = None) -> Plan:
    """``(waiting, tenant's waiting, tenant's quota)``: jobs waiting in every intake queue
    of `model_name` (the tenants' included), those of `tenant`'s queues, and the most
    ``keys.TENANT_MAX_QUEUED`` lets it have (None: no quota, or no `tenant`)."""
    priorities, tenants, quota = yield reads(
        ("smembers", keys.priorities(model_name)), ("smembers", keys.tenant_levels(model_name)),
        ("hget", keys.TENANT_MAX_QUEUED, tenant or ""))
    levels = intake_levels_of(model_name, priorities, tenants)
    lengths = yield reads(*(("llen", rq_queue_key(keys.intake_queue(model_name, p, t)))
                            for p, t in levels))
    mine = sum(n for (_, t), n in zip(levels, lengths, strict=True) if t == tenant)
    return sum(lengths), mine, None if tenant is None else protocol.quota(quota)


def session_holder(session: str) -> Plan:
    """The live worker that keeps `session`'s slot, or None (`protocol.live_holder`)."""
    (holder,) = yield reads(("get", keys.session_holder(session)))
    alive = False
    if holder is not None:
        (alive,) = yield reads(("exists", keys.worker_heartbeat(holder.decode())))
    return protocol.live_holder(holder, bool(alive))


def submit(request: SubmitRequest, limits: Limits, max_queue_depth: int,
           result_ttl_s: int) -> Plan:
    """Enqueue `request`; returns the job id (an idempotent resubmit's first one). Errors
    as `PrefillClient.submit`: `request` is checked against `limits` before any trip."""
    record = request.checked(limits).record(uuid.uuid4().hex, now())
    info, prefix_root = yield from model_and_prefix_root(record.model)
    check_against_model(record, info, limits)
    protocol.check_depth(record.model, *(yield from intake_depth(record.model, record.tenant)),
                         max_queue_depth, tenant=record.tenant)
    claim = None if record.idempotency_key is None else keys.idempotency(record.idempotency_key)
    if claim is not None:
        (claimed,) = yield Trip(lambda pipe: pipe.set(claim, record.job_id, nx=True,
                                                      ex=result_ttl_s))
        if not claimed:
            (first,) = yield reads(("get", claim))
            return first.decode()
    try:
        worker = ((yield from session_holder(record.session)) if record.session
                  else (yield from prefix_holder(record.tokens, prefix_root,
                                                 record.cache_salt)))

        def writes(pipe) -> None:  # the record and its RQ job land together
            pipe.hset(keys.job(record.job_id), mapping=record.to_hash())
            # RQ's Job only holds `pipe` as its connection: nothing is sent through it
            new_admission(pipe, record.job_id, record.model, record.priority,
                          worker=worker, tenant=record.tenant).send(pipe)
            stats.record_submitted(pipe)

        yield Trip(writes, transaction=True)
    except Exception:
        if claim is not None:  # the key is free again; the caller sees the submit's error
            try:
                yield script_trip(scripts.release(claim, record.job_id))
            except Exception:
                pass
        raise
    return record.job_id


def submit_signature(method: Callable) -> Callable:
    """`method`, a client's ``submit(self, prompt=None, **fields)``, with `SubmitRequest`'s
    fields as its keywords in its signature (what ``help()`` and ``inspect`` show)."""
    kind = inspect.Parameter.KEYWORD_ONLY
    fields = [inspect.Parameter(f.name, kind, default=f.default, annotation=f.type)
              for f in dataclasses.fields(SubmitRequest)]
    fields[0] = fields[0].replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)
    self = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__signature__ = inspect.Signature([self, *fields], return_annotation="str")
    return method


# -- status, cancel, result --------------------------------------------------------------

def status(job_id: str) -> Plan:
    """The job's status. Raises JobNotFound, CorruptJob (`protocol.status_of`)."""
    job_id = protocol.checked_id(job_id)
    (raw,) = yield reads(("hgetall", keys.job(job_id)))
    return protocol.status_of(job_id, raw)


def cancel(job_id: str, result_ttl_s: int) -> Plan:
    """Cancel the job; True if this changed anything. Raises JobNotFound."""
    (outcome,) = yield script_trip(protocol.cancel_call(job_id, result_ttl_s))
    ended = stats.terminal(outcome)  # a queued job canceled: no worker will count it
    if ended:  # best effort: the cancel has landed
        yield Trip(lambda pipe: stats.record_terminal(pipe, ended), raise_on_error=False)
    return protocol.cancel_changed(job_id, outcome)


def result(job_id: str, terminal: JobStatus) -> Plan:
    """The result of the job whose `terminal` status a watch saw.

    Raises:
        JobFailed, JobCanceled: as `protocol.check_finished`.
        CorruptJob: the stored result does not decode.
    """
    protocol.check_finished(job_id, terminal)
    blob, (logits, logprobs) = yield reads(
        ("hget", keys.job(job_id), "result"),
        ("mget", keys.logits(job_id), keys.prompt_logprobs(job_id)))
    return protocol.result_of(job_id, blob, logits, logprobs)
