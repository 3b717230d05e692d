"""Weighted fair share between tenants, over tokens prefilled, a chunk at a time.

The virtual token counter of VTC (Sheng et al., "Fairness in Serving Large Language Models",
OSDI 2024, Algorithm 2), with chunks as the unit: each tenant's service is the tokens its
jobs have prefilled over its weight; the tenant with the least service goes first, both
when a worker admits a waiting job and when it picks the jobs of a step; and a tenant that
comes back after having nothing to run is lifted to the least service among the tenants that
do, so it cannot bank credit while idle. Since every charge is one chunk (at most
``step_tokens``), two backlogged tenants' weighted service stays within a few steps' tokens
of each other on one worker.

Across workers the counters live in Redis (``keys.TENANT_SERVICE``): each worker adds its
charges there with its step's round trip and reads the sums back, so a worker orders tenants
by the cluster's service as of its last round trip (one step old at most).

Jobs submitted without a tenant share the tenant ``""`` (`tenant_of`); with no tenants at
all, the order is the plain round robin and first-in first-out of before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from jobs.stats import numbers_of

DEFAULT_WEIGHT = 1.0


def tenant_of(tenant: str | None) -> str:
    """The fair share's name of a job's tenant: ``""`` for a job submitted without one."""
    return tenant or ""


def parse_weights(text: str) -> dict[str, float]:
    """``"a=2,b=0.5"`` as ``{"a": 2.0, "b": 0.5}`` (``--tenant-weights``).

    Raises:
        ValueError: an entry is not ``NAME=WEIGHT`` with a non-empty name and a finite
            weight above 0.
    """
    weights = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        name, sep, value = entry.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = float("nan")
        if not sep or not name or not 0 < weight < float("inf"):
            raise ValueError(f"tenant weight {entry!r}: want NAME=WEIGHT with WEIGHT > 0")
        weights[name] = weight
    return weights


def decode_weights(raw: Mapping[bytes | str, bytes | str]) -> dict[str, float]:
    """HGETALL ``keys.TENANT_WEIGHTS`` as ``{tenant: weight}``; entries that are not a
    finite weight above 0 are skipped (the tenant then weighs `DEFAULT_WEIGHT`)."""
    return {t: w for t, w in numbers_of(raw).items() if 0 < w < float("inf")}


def admission_caps(tenants: list[str | None], held: Mapping[str, int], quota: int,
                   room: int) -> list[int]:
    """At most how many jobs one admission takes from each queue, in the queues' order, with
    `tenants` the queues' tenants (None: the worker's own queue, capped by `room` only),
    `held` the resident jobs by tenant and `quota` the most a tenant may have resident: a
    tenant's room goes to its first queue, none to its later ones (they are taken from at
    the next admission)."""
    held, caps = dict(held), []
    for tenant in tenants:
        if tenant is None:
            caps.append(room)
            continue
        caps.append(max(0, quota - held.get(tenant, 0)))
        held[tenant] = quota
    return caps


class FairShare:
    """Each tenant's virtual service (tokens prefilled over its weight) as one worker knows
    it: the cluster's sums as of the last read (`observe`) plus this worker's charges since
    (`pending`, which its next round trip adds to Redis).

    Args:
        weights: tenant -> weight above 0; a tenant not named weighs `DEFAULT_WEIGHT`.
    """

    def __init__(self, weights: Mapping[str, float] | None = None):
        self.weights: dict[str, float] = dict(weights or {})
        self.service: dict[str, float] = {}
        self.pending: dict[str, float] = {}  # charges not yet added in Redis
        self.lifts: dict[str, float] = {}  # floors not yet set in Redis
        self.tokens: dict[str, int] = {}  # tokens prefilled not yet counted in Redis
        # a tenant other than "" has been seen: the service is read with every round trip
        self.enabled = bool(self.weights)

    def describe(self, max_resident: int | None) -> str:
        """The weights and a tenant's resident quota `max_resident`, as a log line says."""
        weights = ",".join(f"{t}={w:g}" for t, w in sorted(self.weights.items()))
        quota = "no quota" if max_resident is None else f"at most {max_resident}"
        return f"tenant weights: {weights or 'none (all 1)'}; resident per tenant: {quota}"

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, DEFAULT_WEIGHT)

    def of(self, tenant: str) -> float:
        """`tenant`'s virtual service (0 for one never served)."""
        return self.service.get(tenant, 0.0)

    def seen(self, tenant: str) -> None:
        """A job of `tenant` is resident or waiting here."""
        self.enabled = self.enabled or tenant != ""

    def charge(self, tenant: str, tokens: int) -> None:
        """`tenant`'s jobs prefill `tokens` more: its service grows by tokens / weight."""
        amount = tokens / self.weight(tenant)
        self.service[tenant] = self.of(tenant) + amount
        self.pending[tenant] = self.pending.get(tenant, 0.0) + amount
        self.tokens[tenant] = self.tokens.get(tenant, 0) + tokens

    def lift(self, tenant: str, backlogged: Iterable[str]) -> None:
        """`tenant` had nothing to run and now has a job: raise its service to the least of
        the `backlogged` tenants' (VTC's counter lift; no change when none is backlogged or
        it is ahead of them already)."""
        floor = min((self.of(t) for t in backlogged if t != tenant), default=None)
        if floor is not None and floor > self.of(tenant):
            # set in Redis as a floor, not added: two workers lifting one tenant at once
            # must not lift it twice; charges since then are added on top
            self.lifts[tenant] = floor - self.pending.get(tenant, 0.0)
            self.service[tenant] = floor

    def rank(self, tenant: str) -> tuple[float, str]:
        """`tenant`'s place in the fair share's order: least service first, ties by name."""
        return self.of(tenant), tenant

    def order(self, tenants: Iterable[str]) -> list[str]:
        """`tenants` in `rank` order."""
        return sorted(set(tenants), key=self.rank)

    def take_pending(self) -> tuple[dict[str, float], dict[str, float], dict[str, int]]:
        """``(lifts, charges, tokens)`` since the last call, for Redis: each lift a floor to
        raise a tenant's service to (`worker.roundtrip.LIFT`), then each charge to add
        (HINCRBYFLOAT), and the tokens prefilled (``keys.TENANT_TOKENS``); and forget them.
        None until a tenant is seen (`enabled`), so jobs without tenants cost Redis nothing
        more a chunk."""
        taken = (self.lifts, self.pending, self.tokens)
        self.lifts, self.pending, self.tokens = {}, {}, {}
        return taken if self.enabled else ({}, {}, {})

    def observe(self, raw: Mapping[bytes | str, bytes | str]) -> None:
        """HGETALL ``keys.TENANT_SERVICE``, read after this worker's pending charges were
        added: the cluster's service now (plus charges made since they were taken)."""
        service = numbers_of(raw)
        for tenant, floor in self.lifts.items():
            service[tenant] = max(service.get(tenant, 0.0), floor)
        for tenant, amount in self.pending.items():
            service[tenant] = service.get(tenant, 0.0) + amount
        self.service = service
