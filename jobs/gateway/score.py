"""``POST /v1/score``: decoder-only generative scoring, SGLang's ``/v1/score`` request and
response (vLLM serves the same request as ``/v1/generative-scores``): the probability of each
of ``label_token_ids`` as the next token after query + item, for every item.

Rerankers and classifiers ask it of one query and many items ("yes" and "no" after each
document, or one label token per class). With ``item_first`` false the query is one job's
prompt and the items its continuations (`model.continuations`): the query is prefilled once,
and each item from its end. With ``item_first`` each item + query is a job of its own.
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ..defaults import DEFAULT_MODEL, MAX_TOP_K
from ..errors import InvalidRequest
from .body import documented, parsed
from .completions import MAX_BATCH, run_jobs
from .deps import Client, request_tenant, require_api_key
from .liveness import require_live_worker


class ScoreRequest(BaseModel):
    """The body of ``POST /v1/score``. Strict: ``"1"`` is not 1; unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = DEFAULT_MODEL
    query: str | list[int]
    items: list[str] | list[list[int]]
    label_token_ids: list[int] = Field(min_length=1, max_length=MAX_TOP_K)
    apply_softmax: bool = True
    item_first: bool = False
    cache_salt: str | None = None
    tenant: str | None = None  # whose jobs (an API key's tenant wins)


def score_jobs(req: ScoreRequest) -> list[dict[str, Any]]:
    """The `submit` keywords of the jobs that answer `req`: one with the query as prompt and
    the items as continuations, or with ``item_first`` one per item (item + query).

    Raises:
        InvalidRequest: no items, more than ``MAX_BATCH``, or text and token ids mixed.
    """
    if not req.items or len(req.items) > MAX_BATCH:
        raise InvalidRequest(f"items must hold 1 to {MAX_BATCH} items, got {len(req.items)}")
    text = isinstance(req.query, str)
    if any(isinstance(item, str) != text for item in req.items):
        raise InvalidRequest("query and items must all be text or all token ids")
    common = {"model": req.model, "top_k": 0, "label_token_ids": req.label_token_ids,
              "cache_salt": req.cache_salt}
    field = "prompt" if text else "tokens"
    if req.item_first:
        return [{field: item + req.query, **common} for item in req.items]
    return [{field: req.query, "continuations": list(req.items), **common}]


def probabilities(logprobs: list[float], apply_softmax: bool) -> list[float]:
    """The labels' probabilities from their logprobs over the whole vocabulary: as they are
    (``exp``), or renormalized over the labels alone (a softmax of their logits)."""
    if not apply_softmax:
        return [math.exp(lp) for lp in logprobs]
    peak = max(logprobs)
    weights = [math.exp(lp - peak) for lp in logprobs]
    total = math.fsum(weights)
    return [w / total for w in weights]


router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/score", openapi_extra=documented(ScoreRequest))
async def score(req: Annotated[ScoreRequest, Depends(parsed(ScoreRequest))], request: Request,
                client: Client) -> JSONResponse:
    """``{"scores": [[p(label) for each label] for each item], "model", "usage", "object":
    "scoring"}``; blocks until the jobs end. A disconnect cancels them."""
    tenant = request_tenant(request, req.tenant)
    jobs = [job | {"tenant": tenant} for job in score_jobs(req)]
    await require_live_worker(request, req.model)
    outcome = await run_jobs(request, client, jobs)
    if isinstance(outcome, JSONResponse):
        return outcome
    _, results = outcome
    if req.item_first:
        logprobs = [r.label_logprobs for r in results]
        tokens = sum(r.n_tokens for r in results)
    else:
        (result,) = results
        logprobs = [c.label_logprobs for c in result.continuations]
        tokens = result.n_tokens + sum(len(c.tokens) for c in result.continuations)
    return JSONResponse({
        "scores": [probabilities(lps, req.apply_softmax) for lps in logprobs],
        "model": req.model, "object": "scoring", "created": int(time.time()),
        "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens},
    })
