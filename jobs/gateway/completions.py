"""OpenAI-compatible ``POST /v1/completions`` for scoring: the legacy completions request and
response, answered by prefill jobs (at most one token: the argmax of the final logits).

It is what lm-evaluation-harness's ``local-completions`` model sends for log-likelihoods
(``lm_eval/models/openai_completions.py``); docs/gateway.md describes the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ..defaults import DEFAULT_MODEL, MAX_TOP_K
from ..errors import InvalidRequest, JobCanceled, JobFailed
from ..result import PrefillResult
from ..tokenizer import ServedTokenizer
from .body import documented, parsed
from .deps import Client, ClientGone, request_tenant, require_api_key, unless_disconnected
from .errors import error_response, failed_job_status
from .liveness import require_live_worker
from .shared import answers, batch_jobs

log = logging.getLogger(__name__)

# Prompts one request may carry; a larger batch is a job for the native API.
MAX_BATCH = 1024


class CompletionRequest(BaseModel):
    """The body of ``POST /v1/completions`` (OpenAI's legacy completions). Strict: ``"1"``
    is not 1. Unknown fields are accepted and ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = DEFAULT_MODEL
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 1
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_K)
    temperature: float | None = None
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None
    cache_salt: str | None = None  # vLLM's: prefix blocks are shared only within one salt
    tenant: str | None = None  # prefillq's: whose jobs (an API key's tenant wins)


def check_request(req: CompletionRequest) -> None:
    """Raise InvalidRequest for what a prefill cannot answer, naming the field."""
    tokens = 1 if req.max_tokens is None else req.max_tokens
    if tokens not in (0, 1):
        raise InvalidRequest(f"max_tokens must be 0 or 1, got {tokens}: this service only "
                             "prefills (the one token is the argmax of the final logits)")
    if tokens and req.temperature not in (None, 0.0):
        raise InvalidRequest("temperature must be 0: the one token is the argmax of the final "
                             "logits, not a sample")
    if req.n != 1 or req.best_of not in (None, 1):
        raise InvalidRequest("n and best_of must be 1: a prefill has one greedy completion")
    if req.stream:
        raise InvalidRequest("stream is not supported: GET /v1/prefill/{id}/events streams a "
                             "job's progress")
    if req.suffix:
        raise InvalidRequest("suffix is not supported")
    if req.logit_bias:
        raise InvalidRequest("logit_bias is not supported")


def prompt_inputs(prompt: str | list) -> list[dict[str, Any]]:
    """Each prompt of a request as `submit`'s input, ``{"prompt": text}`` or
    ``{"tokens": ids}``. Raises InvalidRequest for an empty or oversized batch."""
    if isinstance(prompt, str):
        batch: Sequence = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        batch = [prompt]  # one prompt of token ids
    else:
        batch = prompt
    if not batch:
        raise InvalidRequest("prompt is empty")
    if len(batch) > MAX_BATCH:
        raise InvalidRequest(f"prompt holds {len(batch)} prompts; at most {MAX_BATCH}")
    return [{"prompt": p} if isinstance(p, str) else {"tokens": list(p)} for p in batch]


def job_options(req: CompletionRequest) -> dict[str, Any]:
    """The `submit` keywords every job of `req` shares: top_k covers the argmax and the
    ``logprobs`` alternatives; echoed logprobs need the prompt's."""
    options: dict[str, Any] = {"model": req.model, "top_k": max(req.logprobs or 0, 1),
                               "cache_salt": req.cache_salt}
    if req.echo and req.logprobs is not None:
        options["prompt_logprobs"] = req.logprobs
    return options


def needs_tokenizer(req: CompletionRequest, inputs: Sequence[dict], score_with_bos: bool) -> bool:
    """Token strings are needed for logprobs, the text of token-id prompts for echo, and
    the BOS id for `with_bos`."""
    token_ids = any("tokens" in i for i in inputs)
    return req.logprobs is not None or (token_ids and (req.echo or score_with_bos))


def with_bos(inputs: Sequence[dict], bos_id: int | None) -> list[dict]:
    """`inputs` as submitted under ``--score-with-bos``: token ids that do not start with
    `bos_id` get it in front, scored as context and never echoed (`echo_start`)."""
    if bos_id is None:
        return list(inputs)
    return [{"tokens": [bos_id, *i["tokens"]]} if i.get("tokens") and i["tokens"][0] != bos_id
            else i for i in inputs]


@dataclass
class Scored:
    """One prompt's job: the client's input (before `with_bos`), and its result once
    finished."""

    input: dict[str, Any]
    result: PrefillResult


def choice(index: int, scored: Scored, req: CompletionRequest,
           tokenizer: ServedTokenizer | None) -> dict[str, Any]:
    """One ``choices[]`` entry: ``text`` (the prompt when echoed, then the token when
    ``max_tokens`` is 1) and ``logprobs`` (None unless asked for), whose tokens spell
    ``text``."""
    result, generate = scored.result, (1 if req.max_tokens is None else req.max_tokens)
    if req.logprobs is not None:
        logprobs = logprobs_of(scored, req, tokenizer, generate)
        text = "".join(logprobs["tokens"])
    else:
        logprobs, text = None, result.top_k[0].piece if generate else ""
        if req.echo:
            prompt = scored.input.get("prompt")
            if prompt is None:
                prompt = tokenizer.decode(scored.input["tokens"])
            text = prompt + text
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": "length"}


def echo_start(scored: Scored, tokenizer: ServedTokenizer) -> int:
    """The job's first position the echo covers: past the BOS the client did not send (the
    one the model's tokenizer puts before a text prompt, or `with_bos`'s)."""
    if "tokens" in scored.input:
        return scored.result.n_tokens - len(scored.input["tokens"])
    return int(tokenizer.add_bos and tokenizer.bos_id is not None)


def logprobs_of(scored: Scored, req: CompletionRequest, tokenizer: ServedTokenizer,
                generate: int) -> dict[str, list]:
    """The legacy ``logprobs`` object: ``tokens`` (each token's share of the choice's text:
    `ServedTokenizer.pieces`), ``token_logprobs`` (None for a first token with no context),
    ``top_logprobs`` (K strings -> logprob, highest first; None where the logprob is) and
    ``text_offset`` (each token's character offset in the text)."""
    result = scored.result
    entries: list[tuple[int, float | None, list[dict] | None]] = []
    if req.echo:
        start = echo_start(scored, tokenizer)
        for i, e in enumerate(result.prompt_logprobs[start:-1], start):
            entries.append((e["token"], e["logprob"], None if i == 0 else e["top"]))
    tokens = tokenizer.pieces([token for token, _, _ in entries])
    if generate:
        best = result.top_k[0]
        entries.append((best.id, best.logprob, [{"id": t.id, "logprob": t.logprob}
                                                for t in result.top_k[:req.logprobs]]))
        tokens.append(tokenizer.piece(best.id))
    return {
        "tokens": tokens,
        "token_logprobs": [logprob for _, logprob, _ in entries],
        "top_logprobs": [None if top is None else _top_dict(top, tokenizer)
                         for _, _, top in entries],
        "text_offset": list(accumulate((len(t) for t in tokens), initial=0))[:-1],
    }


def _top_dict(top: list[dict], tokenizer: ServedTokenizer) -> dict[str, float]:
    out: dict[str, float] = {}
    for t in top:  # highest first: two ids with one string keep the likelier
        out.setdefault(tokenizer.piece(t["id"]), t["logprob"])
    return out


def response(job_ids: Sequence[str], req: CompletionRequest, scored: Sequence[Scored],
             tokenizer: ServedTokenizer | None) -> dict[str, Any]:
    """The ``text_completion`` object of a finished batch. ``usage.prompt_tokens_details
    .cached_tokens`` counts the prompt tokens a worker reused instead of computing (a
    session's slot or its prefix cache), as OpenAI's and vLLM's usage does."""
    generate = 1 if req.max_tokens is None else req.max_tokens
    prompt_tokens = sum(s.result.n_tokens for s in scored)
    return {
        "id": f"cmpl-{job_ids[0]}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [choice(i, s, req, tokenizer) for i, s in enumerate(scored)],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": generate * len(scored),
                  "total_tokens": prompt_tokens + generate * len(scored),
                  "prompt_tokens_details": {
                      "cached_tokens": sum(s.result.cached_tokens for s in scored)}},
    }


async def cancel_all(client, job_ids: Sequence[str]) -> None:
    """Cancel every job of a batch that is given up on (best effort, concurrently); a
    cancel that fails is logged, and its job runs on to its end."""
    outcomes = await asyncio.gather(*(client.cancel(j) for j in job_ids),
                                    return_exceptions=True)
    for job_id, outcome in zip(job_ids, outcomes, strict=True):
        if isinstance(outcome, Exception):
            log.warning("could not cancel job %s of a request given up on: %r", job_id, outcome)


router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/completions", openapi_extra=documented(CompletionRequest))
async def completions(req: Annotated[CompletionRequest, Depends(parsed(CompletionRequest))],
                      request: Request, client: Client) -> JSONResponse:
    """Score a prompt or a batch; blocks until every job ends. A disconnect cancels them.
    Token-id prompts of a batch that share a prefix share one job (`jobs.gateway.shared`)."""
    check_request(req)
    inputs = prompt_inputs(req.prompt)
    await require_live_worker(request, req.model)
    score_with_bos: bool = request.app.state.score_with_bos
    tokenizer = (await client.tokenizer(req.model)
                 if needs_tokenizer(req, inputs, score_with_bos) else None)
    jobs = (with_bos(inputs, tokenizer.bos_id) if score_with_bos and tokenizer is not None
            else inputs)
    options = job_options(req) | {"tenant": request_tenant(request, req.tenant)}
    batch = batch_jobs(jobs, client.limits)
    outcome = await run_jobs(request, client, [{**job.input, **options} for job in batch])
    if isinstance(outcome, JSONResponse):
        return outcome
    job_ids, results = outcome
    scored = [Scored(i, r) for i, r in zip(inputs, answers(batch, results), strict=True)]
    return JSONResponse(response(job_ids, req, scored, tokenizer))


async def run_jobs(request: Request, client, jobs: Sequence[dict[str, Any]]
                   ) -> tuple[list[str], list[PrefillResult]] | JSONResponse:
    """Submit `jobs` (`submit`'s keywords each) together and wait for all: their ids and
    results in order, or the response to give instead: 499 when the client went away, the
    failed job's error or 409 for a canceled one. Every job of the batch is canceled then
    (and when a submit is refused, whose error is raised).

    Raises:
        the first submit's error (InvalidRequest, UnknownModel, QueueFull, ...).
    """
    submitted = await asyncio.gather(*(client.submit(**job) for job in jobs),
                                     return_exceptions=True)
    job_ids = [j for j in submitted if isinstance(j, str)]
    refused = next((e for e in submitted if isinstance(e, BaseException)), None)
    if refused is not None:
        await cancel_all(client, job_ids)
        raise refused
    try:
        results = await unless_disconnected(
            request, asyncio.gather(*(client.result(j) for j in job_ids)))
    except ClientGone:
        await cancel_all(client, job_ids)
        return JSONResponse({}, status_code=499)  # nobody reads it; logged as 499, as nginx
    except JobFailed as e:
        await cancel_all(client, job_ids)
        return error_response(failed_job_status(e), e.error_type, e.message)
    except JobCanceled as e:
        await cancel_all(client, job_ids)
        return error_response(409, "JobCanceled", str(e))
    return job_ids, list(results)
