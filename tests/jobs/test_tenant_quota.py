"""A tenant's quota of queued jobs (``keys.TENANT_MAX_QUEUED``): a submit past it raises
QueueFull for that tenant only, with a registered worker's model on a real redis-server."""

from __future__ import annotations

import pytest

from jobs import PrefillClient, QueueFull, keys
from tests.worker.helpers import MODEL


def test_a_tenant_at_its_queued_quota_is_refused_and_no_one_else(worker, connect):
    conn = connect()
    client = PrefillClient(conn)
    conn.hset(keys.TENANT_MAX_QUEUED, "acme", 2)
    jobs = [client.submit(tokens=[2, 300], model=MODEL, tenant="acme") for _ in range(2)]
    assert client.status(jobs[0]).tenant == "acme"  # a job's status shows whose it is
    with pytest.raises(QueueFull, match="^tenant 'acme' is at its quota of 2 queued jobs"):
        client.submit(tokens=[2, 300], model=MODEL, tenant="acme", priority=5)
    client.submit(tokens=[2, 300], model=MODEL, tenant="other")  # others go on
    client.submit(tokens=[2, 300], model=MODEL)
    conn.hset(keys.TENANT_MAX_QUEUED, "acme", "junk")  # junk is no quota
    client.submit(tokens=[2, 300], model=MODEL, tenant="acme")
    assert conn.llen("rq:queue:" + keys.intake_queue(MODEL, 0, "acme")) == 3
