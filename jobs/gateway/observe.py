"""``/health`` and ``/metrics`` (Prometheus text format), open without the API key as
monitoring expects. Both read the cluster's numbers from Redis (`jobs.stats`), so every
gateway replica reports the whole cluster, whichever worker did the work."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from redis.exceptions import RedisError

from ..stats import ClusterStats, read_cluster_stats
from .deps import Client

router = APIRouter()


@router.get("/health")
async def health(client: Client) -> JSONResponse:
    """200 when Redis answers and at least one live worker serves a model; 503 otherwise.
    The body: ``status``, ``redis`` (reachable), ``workers`` (alive) and, per registered
    model, its ``live_workers``."""
    try:
        stats = await read_cluster_stats(client.redis)
    except (RedisError, OSError) as e:
        return JSONResponse({"status": "unavailable", "redis": False,
                             "error": type(e).__name__}, status_code=503)
    serving = bool(stats.served_models)
    body = {"status": "ok" if serving else "no live worker", "redis": True,
            "workers": stats.workers_alive,
            "models": {m: {"live_workers": n} for m, n in sorted(stats.live_workers.items())}}
    return JSONResponse(body, status_code=200 if serving else 503)


@router.get("/metrics")
async def metrics(client: Client) -> Response:
    """The cluster's numbers in Prometheus's text format (`Snapshot` names them)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Snapshot(await read_cluster_stats(client.redis)))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


class Snapshot:
    """A prometheus-client collector of one `ClusterStats` read.

    Families: ``prefillq_jobs_total{state}`` (submitted, finished, failed, canceled),
    ``prefillq_jobs_current{state}`` (queued, prefilling now), ``prefillq_queue_depth{model}``,
    ``prefillq_routed_queue_depth``, ``prefillq_tokens_prefilled_total``,
    ``prefillq_tokens_reused_total``,
    ``prefillq_chunk_seconds`` (histogram of chunk forward passes),
    ``prefillq_workers{state}`` (alive, dead) and ``prefillq_live_workers{model}``.
    """

    def __init__(self, stats: ClusterStats):
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        jobs = CounterMetricFamily("prefillq_jobs", "Jobs submitted, and ended by state",
                                   labels=["state"])
        for state, n in s.totals().items():
            jobs.add_metric([state], n)
        now = GaugeMetricFamily("prefillq_jobs_current", "Jobs waiting or prefilling now",
                                labels=["state"])
        now.add_metric(["queued"], s.queued)
        now.add_metric(["prefilling"], s.prefilling)
        depth = GaugeMetricFamily("prefillq_queue_depth",
                                  "Jobs in a model's intake queues", labels=["model"])
        for model, n in sorted(s.queue_depth.items()):
            depth.add_metric([model], n)
        yield from (jobs, now, depth)
        yield GaugeMetricFamily("prefillq_routed_queue_depth",
                                "Jobs in workers' own queues (sessions' next turns)",
                                value=s.routed)
        yield CounterMetricFamily("prefillq_tokens_prefilled",
                                  "Tokens run through a forward pass", value=s.tokens_prefilled)
        yield CounterMetricFamily("prefillq_tokens_reused",
                                  "Prompt tokens of finished jobs reused from a session's slot "
                                  "or a prefix cache", value=s.tokens_reused)
        yield CounterMetricFamily("prefillq_prefix_cache_hits",
                                  "Finished jobs that reused a prefix from a worker's prefix "
                                  "cache", value=s.prefix_hits)
        yield CounterMetricFamily("prefillq_prefix_cache_misses",
                                  "Finished jobs a worker's prefix cache held no prefix of",
                                  value=s.prefix_misses)
        yield GaugeMetricFamily("prefillq_prefix_cache_bytes",
                                "Bytes live workers' prefix caches hold", value=s.prefix_bytes)
        h = s.chunks
        buckets = [(repr(float(b)), n) for b, n in zip(h.bounds, h.cumulative, strict=False)]
        yield HistogramMetricFamily("prefillq_chunk_seconds", "Seconds of a chunk's forward pass",
                                    buckets=[*buckets, ("+Inf", h.cumulative[-1])],
                                    sum_value=h.sum_seconds)
        workers = GaugeMetricFamily("prefillq_workers", "Registered workers by heartbeat",
                                    labels=["state"])
        workers.add_metric(["alive"], s.workers_alive)
        workers.add_metric(["dead"], s.workers_dead)
        live = GaugeMetricFamily("prefillq_live_workers", "Live workers serving a model",
                                 labels=["model"])
        for model, n in sorted(s.live_workers.items()):
            live.add_metric([model], n)
        yield from (workers, live)
        yield from tenant_metrics(s)


def tenant_metrics(s: ClusterStats) -> Iterator[Metric]:
    """Per tenant (label ``tenant``; ``""``: jobs without one): queued, prefilling, tokens
    prefilled, virtual service; and the service spread between tenants with work now."""
    families = (
        (GaugeMetricFamily, "prefillq_tenant_queued", "A tenant's jobs in intake queues",
         "queued"),
        (GaugeMetricFamily, "prefillq_tenant_prefilling", "A tenant's jobs live workers hold",
         "prefilling"),
        (CounterMetricFamily, "prefillq_tenant_tokens_prefilled",
         "Tokens a tenant's jobs ran through a forward pass", "tokens_prefilled"),
        (GaugeMetricFamily, "prefillq_tenant_service",
         "A tenant's virtual service: tokens prefilled over its weight, lifted on return",
         "service"))
    for kind, name, text, attribute in families:
        family = kind(name, text, labels=["tenant"])
        for tenant, numbers in s.tenants.items():
            family.add_metric([tenant], getattr(numbers, attribute))
        yield family
    yield GaugeMetricFamily("prefillq_tenant_service_spread",
                            "Largest virtual service difference between tenants with jobs "
                            "queued or prefilling", value=s.service_spread)
