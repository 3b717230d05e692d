"""The native jobs API: `AsyncPrefillClient` over HTTP, at ``/v1/prefill`` and ``/v1/models``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse, ServerSentEvent

from ..errors import InvalidRequest, JobCanceled, JobFailed, JobTimeout
from ..requests import SUBMIT_FIELDS
from ..result import result_record
from ..schema import JobStatus
from .body import json_object
from .deps import Client, ClientGone, request_tenant, require_api_key, unless_disconnected
from .errors import error_body
from .liveness import Live, require_live_worker

# Longest `?wait=` (s): a longer wait belongs in a loop of waits or in `/events`.
MAX_WAIT_S = 600.0

router = APIRouter(dependencies=[Depends(require_api_key)])


def submit_fields(body: dict[str, Any]) -> dict[str, Any]:
    """`body` as `submit`'s keywords (`SubmitRequest`'s fields): anything else is refused,
    so a typo is not ignored. Raises InvalidRequest naming an unknown field."""
    unknown = sorted(set(body) - SUBMIT_FIELDS)
    if unknown:
        raise InvalidRequest(f"unknown field {unknown[0]!r}; the fields are "
                             + ", ".join(sorted(SUBMIT_FIELDS)))
    return body


@router.post("/v1/prefill", status_code=202)
async def create(request: Request,
                 client: Client) -> JSONResponse:
    """Enqueue a prefill: 202 ``{"job_id", "state"}`` (``queued``, unless an
    ``idempotency_key`` named an earlier job)."""
    fields = submit_fields(await json_object(request))
    tenant = request_tenant(request, fields.get("tenant"))
    if tenant is not None:
        fields["tenant"] = tenant
    await require_live_worker(request, fields.get("model"))
    job_id = await client.submit(**fields)
    state = "queued"  # a new job is; an idempotent resubmit's may have run since
    if fields.get("idempotency_key") is not None:
        state = (await client.status(job_id)).state.value
    return JSONResponse({"job_id": job_id, "state": state}, status_code=202,
                        headers={"Location": f"/v1/prefill/{job_id}"})


async def existing(job_id: str, client: Client) -> JobStatus:
    """The job's status (a dependency, so a missing job is a 404 before any stream starts)."""
    return await client.status(job_id)


Job = Annotated[JobStatus, Depends(existing)]


@router.get("/v1/prefill/{job_id}")
async def status(job: Job) -> dict:
    """The status, as ``prefillq status --json`` prints it."""
    return job.to_dict()


@router.get("/v1/prefill/{job_id}/result")
async def result(request: Request, job_id: str, client: Client,
                 wait: float = Query(0.0, ge=0.0, le=MAX_WAIT_S,
                                     description="seconds to wait for a terminal state"),
                 ) -> JSONResponse:
    """200 with the result once finished (plus ``logits`` for ``logits="full"``); 202 with
    the status while it is not terminal after `wait` seconds; 409 ``JobFailed`` or
    ``JobCanceled`` with the status."""
    try:
        done = await unless_disconnected(request, client.result(job_id, timeout=wait))
    except JobTimeout:
        return JSONResponse((await client.status(job_id)).to_dict(), status_code=202)
    except (JobFailed, JobCanceled) as e:
        body = error_body(409, type(e).__name__, str(e))
        body["job"] = (await client.status(job_id)).to_dict()
        return JSONResponse(body, status_code=409)
    except ClientGone:
        return JSONResponse({}, status_code=499)  # nobody reads it; logged as 499, as nginx
    record = result_record(await client.status(job_id), done)
    if done.logits is not None:
        record["logits"] = done.logits.tolist()
    return JSONResponse(record)


@router.delete("/v1/prefill/{job_id}")
async def cancel(job_id: str, client: Client) -> dict:
    """``{"job_id", "changed": bool, "state"}``: ``changed`` is False when the job had ended
    or a cancel was already pending; a prefilling job stops at its next chunk boundary."""
    changed = await client.cancel(job_id)
    return {"job_id": job_id, "changed": changed,
            "state": (await client.status(job_id)).state.value}


@router.get("/v1/prefill/{job_id}/events", response_class=EventSourceResponse)
async def events(job: Job,
                 client: Client
                 ) -> AsyncIterator[ServerSentEvent]:
    """Server-Sent Events, one per status change (each chunk's cursor, ``n_tokens`` and
    ``progress``; chunks that end faster than the stream is read are coalesced), the terminal
    one last; the event name is ``status`` or the terminal state.
    """
    async for now in client.watch(job.job_id):
        name = now.state.value if now.state.is_terminal else "status"
        yield ServerSentEvent(event=name, data=now.to_dict())


@router.get("/v1/models")
async def models(live: Live, client: Client) -> dict:
    """OpenAI's ``{"object": "list", "data": [...]}`` of the registered models a live worker
    serves (a job for one is taken), each with its serving limits."""
    served = await live.read()
    registered = await client.models()
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "prefillq",
         "context_length": info.context_length, "vocab_size": info.vocab_size,
         "architecture": info.architecture, "sha256": info.sha256}
        for name, info in sorted(registered.items()) if name in served]}
