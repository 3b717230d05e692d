"""Fault injection for the reliability tests: a plan read once, when a worker is built.

`FaultPlan` documents the ``$PREFILLQ_FAULTS`` format; unset (production), there is no plan.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

log = logging.getLogger("prefillq.worker")

FAULTS_ENV = "PREFILLQ_FAULTS"
KINDS = ("raise_in_chunk", "pause_before_publish", "pause_before_start")
_INT_KEYS = ("tokens", "chunk")
# a paused worker sleeps this long unless the rule says otherwise: past any test's timeout
DEFAULT_PAUSE_S = 600.0
# how often a pause with ``until`` looks for its file
PAUSE_POLL_S = 0.05


class InjectedFault(RuntimeError):
    """Raised inside the model's forward pass by a ``raise_in_chunk`` rule."""


@dataclass(frozen=True)
class FaultRule:
    """One rule of a `FaultPlan` (its docstring has the kinds and keys)."""

    kind: str
    job: str | None = None
    tokens: int | None = None
    attempts: frozenset[int] | None = None
    chunk: int = 1
    seconds: float = DEFAULT_PAUSE_S
    until: str | None = None

    def matches(self, job_id: str, n_tokens: int, attempt: int) -> bool:
        return ((self.job is None or self.job == job_id)
                and (self.tokens is None or self.tokens == n_tokens)
                and (self.attempts is None or attempt in self.attempts))

    @classmethod
    def parse(cls, text: str) -> FaultRule:
        """One ``kind[:key=value]...`` rule.

        Raises:
            ValueError: an unknown kind or key, or a value that does not parse.
        """
        kind, *pairs = text.strip().split(":")
        if kind not in KINDS:
            raise ValueError(f"{FAULTS_ENV}: unknown fault {kind!r} (known: {', '.join(KINDS)})")
        fields: dict = {"kind": kind}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            try:
                if not sep or key not in ("job", "attempts", "seconds", "until", *_INT_KEYS):
                    raise ValueError("unknown key")
                if key in _INT_KEYS:
                    fields[key] = int(value)
                elif key == "attempts":
                    fields[key] = frozenset(int(a) for a in value.split(","))
                elif key == "seconds":
                    fields[key] = float(value)
                else:  # job, until
                    fields[key] = value
            except ValueError:
                raise ValueError(f"{FAULTS_ENV}: bad {pair!r} in {text!r}") from None
        return cls(**fields)


class FaultyModel:
    """A job's model whose forward pass raises on the `rule`'s chunk; everything else is
    the wrapped model's."""

    def __init__(self, model, rule: FaultRule, job_id: str):
        self._model, self._rule, self._job_id = model, rule, job_id
        self._calls = 0

    def __call__(self, inputs, cache, **kwargs):
        out = self._model(inputs, cache, **kwargs)
        self._calls += 1
        if self._calls == self._rule.chunk:
            log.warning("fault: job %s raises in chunk %d", self._job_id, self._calls)
            raise InjectedFault(f"injected fault in chunk {self._calls} of job {self._job_id}")
        return out

    def __getattr__(self, name: str):
        return getattr(self._model, name)


class FaultPlan:
    """The rules a worker runs with, for tests only.

    ``$PREFILLQ_FAULTS`` holds the plan: rules separated by ``;``, each
    ``kind[:key=value]...``. The kinds:

    - ``raise_in_chunk``: the forward pass of a matching job raises `InjectedFault` after the
      model ran, so the cache holds the chunk's rows uncommitted, as a real error inside the
      model leaves it (`model.chunk.launch_chunk` poisons it). ``chunk=N`` picks the Nth
      forward pass of the attempt (default 1).
    - ``pause_before_publish``: once a matching job's last chunk ran and its logits are
      computed, the worker logs ``fault: job <id> paused before_publish`` and sleeps
      ``seconds=S`` (default 600) before the publish script, its heartbeat thread beating
      on, so a test can SIGKILL it exactly there; with ``until=PATH`` (no ``:`` or ``;`` in
      it) it goes on once that file exists (at most S seconds), so a test can change the
      world first.
    - ``pause_before_start``: the same, once the worker dequeued a job and prepared it (its
      tokens, plan and cache), before the script that takes it (``queued -> prefilling``);
      its attempt is the one about to begin.

    Selectors, for every kind; each one given must match: ``job=<id>``, ``tokens=N`` (the
    prompt's length) and ``attempts=1,2`` (the job's attempt numbers it fires on; default
    every attempt). Attempts are the job's own (Redis counts them), so a rule fires the same
    way on whichever worker runs the attempt.

    Example: ``PREFILLQ_FAULTS="raise_in_chunk:tokens=40:chunk=2:attempts=1,2"`` fails the
    second chunk of a 40-token job's first two attempts; the third runs clean.

    Unset (production), `from_env` returns None: no model is wrapped and the cost is an
    ``is None`` test or two per job start and one per publish. Set, the worker logs a
    warning naming the plan when it is built.
    """

    def __init__(self, rules: list[FaultRule]):
        self.rules = rules

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        """Rules separated by ``;``. Raises ValueError (`FaultRule.parse`)."""
        return cls([FaultRule.parse(part) for part in text.split(";") if part.strip()])

    @classmethod
    def from_env(cls) -> FaultPlan | None:
        """The plan in ``$PREFILLQ_FAULTS``, or None when it is unset or empty (production).

        Raises:
            ValueError: the variable does not parse.
        """
        text = os.environ.get(FAULTS_ENV, "").strip()
        if not text:
            return None
        plan = cls.parse(text)
        log.warning("fault injection is on (%s=%r): for tests only", FAULTS_ENV, text)
        return plan

    def _first(self, kind: str, job_id: str, n_tokens: int, attempt: int) -> FaultRule | None:
        return next((r for r in self.rules
                     if r.kind == kind and r.matches(job_id, n_tokens, attempt)), None)

    def install(self, active) -> None:
        """Wrap the model of the resident job `active` (a `worker.active.ActiveJob`) when a
        ``raise_in_chunk`` rule matches its attempt."""
        p = active.prefill
        rule = self._first("raise_in_chunk", active.job_id, p.n_tokens, active.attempt)
        if rule is not None:
            p.model = FaultyModel(p.model, rule, active.job_id)

    def pause(self, point: str, job_id: str, n_tokens: int, attempt: int) -> None:
        """Sleep here when a ``pause_<point>`` rule matches the job's attempt.

        Args:
            point: ``before_publish`` or ``before_start``.
            n_tokens: the job's prompt length (0 when its input failed).
            attempt: the attempt the job is in (or, before its start, about to begin).
        """
        rule = self._first(f"pause_{point}", job_id, n_tokens, attempt)
        if rule is None:
            return
        log.warning("fault: job %s paused %s (%g s)", job_id, point, rule.seconds)
        end = time.monotonic() + rule.seconds
        while time.monotonic() < end:
            if rule.until is not None and os.path.exists(rule.until):
                log.warning("fault: job %s goes on (%s exists)", job_id, rule.until)
                return
            time.sleep(min(PAUSE_POLL_S, max(0.0, end - time.monotonic())))
