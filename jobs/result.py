"""A finished job's result, both ways: what a worker writes (`result_blob`, `logits_blob`,
`prompt_logprobs_blob`) and what clients read back (`PrefillResult.from_blob`,
`prompt_logprobs_of`), side by side as `jobs.record` is for the job hash. Raw arrays travel as
little-endian bytes in msgpack; the worker converts its arrays before calling, so the client
side needs no numpy.
"""

from __future__ import annotations

import array
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from .schema import JobStatus
from .serializer import packb, unpackb


@dataclass
class TopLogit:
    id: int
    logit: float
    logprob: float
    piece: str


@dataclass
class ContinuationResult:
    """One continuation's score given the prompt (``submit(continuations=...)``), as lm-eval's
    log-likelihood requests need it.

    Attributes:
        tokens: its token ids (given, or its text's: docs/client.md says how text is split).
        logprob: the sum of `token_logprobs` (natural log).
        is_greedy: each token is the most likely one after what precedes it.
        token_logprobs: ``log p(tokens[j] | prompt, tokens[:j])`` for each j.
        top: with ``prompt_logprobs=K``, the K likeliest ids at each of its positions,
            ``[[{"id": int, "logprob": float}, ...], ...]`` highest first; else empty lists.
        top_k: the job's ``top_k`` highest logits after the whole continuation (as the
            job's own ``top_k`` is after the prompt): the token a generation would add.
        label_logprobs: the logprob of each of the job's ``label_token_ids`` after the
            whole continuation (empty without them).
    """

    tokens: list[int]
    logprob: float
    is_greedy: bool
    token_logprobs: list[float]
    top: list[list[dict]]
    top_k: list[TopLogit]
    label_logprobs: list[float]

    @classmethod
    def from_dict(cls, data: dict) -> ContinuationResult:
        """The inverse of ``asdict`` (`result_blob`'s encoding)."""
        return cls(**{**data, "top_k": [TopLogit(**t) for t in data["top_k"]]})


@dataclass
class PrefillResult:
    """What a finished job produced.

    Attributes:
        top_k: highest logits first; ``logprob`` is log-softmax over the whole vocabulary.
        logits: float32 ``[vocab]`` (``array('f')``) when submitted with ``logits="full"``.
        prompt_logprobs: with ``prompt_logprobs=K``, n_tokens + 1 entries
            ``{"token": int | None, "logprob": float | None, "top": [{"id": int,
            "logprob": float}, ...]}`` (`prompt_logprobs_of`); else None.
        continuations: with ``continuations``, one `ContinuationResult` each, in order;
            ``top_k``, ``logits`` and ``prompt_logprobs`` are the prompt's.
        label_logprobs: with ``label_token_ids``, the logprob of each after the prompt.
        timings: ``queue_wait_s``, ``prefill_s`` (first start to finish), ``compute_s``
            (forward passes only), ``tokens_per_s`` ((n_tokens - cached_tokens) / prefill_s:
            tokens prefilled, not reused from a session's slot).
    """

    job_id: str
    n_tokens: int
    cached_tokens: int
    reuse: str
    chunks_done: int
    top_k: list[TopLogit]
    timings: dict[str, float]
    model_sha256: str
    logits: array.array | None = field(default=None, repr=False)
    prompt_logprobs: list[dict] | None = field(default=None, repr=False)
    continuations: list[ContinuationResult] | None = None
    label_logprobs: list[float] | None = None

    @classmethod
    def from_blob(cls, job_id: str, blob: bytes, logits: bytes | None,
                  prompt_logprobs: bytes | None = None) -> PrefillResult:
        data = unpackb(blob)
        values = None
        if logits is not None:
            values = array.array("f")
            values.frombytes(unpackb(logits))
        return cls(
            job_id=job_id,
            n_tokens=data["n_tokens"],
            cached_tokens=data.get("cached_tokens", 0),
            reuse=data.get("reuse", "cold"),
            chunks_done=data["chunks_done"],
            top_k=[TopLogit(**t) for t in data["top_k"]],
            timings=data["timings"],
            model_sha256=data["model_sha256"],
            logits=values,
            prompt_logprobs=None if prompt_logprobs is None else prompt_logprobs_of(
                prompt_logprobs),
            continuations=None if data.get("continuations") is None else [
                ContinuationResult.from_dict(c) for c in data["continuations"]],
            label_logprobs=data.get("label_logprobs"),
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("logits")
        return out


def result_record(status: JobStatus, result: PrefillResult | None) -> dict:
    """What ``prefillq result --json`` prints and ``GET /v1/prefill/{id}/result`` returns:
    the status fields merged with the result's (not its full logits), plus ``chunks``
    (= ``chunks_done``)."""
    record = status.to_dict()
    if result is not None:
        record.update(result.to_dict())
        record["chunks"] = result.chunks_done
    else:
        record["chunks"] = status.chunks_done
    return record


def _floats(blob: bytes, code: str) -> list:
    values = array.array(code)
    values.frombytes(blob)
    return values.tolist()


def prompt_logprobs_of(blob: bytes) -> list[dict]:
    """Decode a job's prompt logprobs key (OpenAI's ``echo`` convention, docs/gateway.md).

    The key is msgpack ``{"k": K, "ids": int32 (n,), "token_logprob": float32 (n + 1,),
    "top_ids": int32 (n + 1, K), "top_logprobs": float32 (n + 1, K)}``, arrays as raw
    little-endian bytes and NaN where there is no value.

    Returns:
        n + 1 entries: entry i < n is prompt token i, ``{"token": id, "logprob": log p(ids[i]
        | ids[:i]) (None at i = 0), "top": the K likeliest ids given ids[:i] (empty at
        i = 0)}``; entry n, after the prompt, is ``{"token": None, "logprob": None, "top":
        the final logits' top K}`` (the ``top_k`` result's logprobs). ``top`` is
        ``[{"id": int, "logprob": float}, ...]``, highest first.
    """
    data = unpackb(blob)
    k, ids = data["k"], _floats(data["ids"], "i")
    token = _floats(data["token_logprob"], "f")
    top_ids, top_lp = _floats(data["top_ids"], "i"), _floats(data["top_logprobs"], "f")
    out = []
    for i in range(len(ids) + 1):
        top = [] if i == 0 else [{"id": top_ids[j], "logprob": top_lp[j]}
                                 for j in range(i * k, (i + 1) * k)]
        out.append({"token": ids[i] if i < len(ids) else None,
                    "logprob": None if math.isnan(token[i]) else token[i], "top": top})
    return out


def result_blob(*, n_tokens: int, cached_tokens: int, reuse: str, chunks_done: int,
                top_k: Iterable[TopLogit], timings: dict[str, float],
                model_sha256: str,
                continuations: Iterable[ContinuationResult] | None = None,
                label_logprobs: list[float] | None = None) -> bytes:
    """The msgpack of a finished job's ``result`` field, which `PrefillResult.from_blob`
    decodes (the fields are `PrefillResult`'s)."""
    return packb({"n_tokens": n_tokens, "cached_tokens": cached_tokens, "reuse": reuse,
                  "chunks_done": chunks_done, "top_k": [asdict(t) for t in top_k],
                  "timings": timings, "model_sha256": model_sha256,
                  "continuations": None if continuations is None else [
                      asdict(c) for c in continuations], "label_logprobs": label_logprobs})


def logits_blob(logits: bytes) -> bytes:
    """The msgpack of a job's logits key: float32 little-endian ``(vocab,)`` bytes, which
    `PrefillResult.from_blob` reads into ``array('f')``."""
    return packb(logits)


def prompt_logprobs_blob(*, k: int, ids: bytes, token_logprob: bytes, top_ids: bytes,
                         top_logprobs: bytes) -> bytes:
    """The msgpack of a job's prompt logprobs key, which `prompt_logprobs_of` decodes: `k`,
    and little-endian raw arrays: int32 ``ids`` ``(n,)``, float32 ``token_logprob``
    ``(n + 1,)``, int32 ``top_ids`` and float32 ``top_logprobs`` ``(n + 1, k)``, NaN where
    there is no value."""
    return packb({"k": k, "ids": ids, "token_logprob": token_logprob, "top_ids": top_ids,
                  "top_logprobs": top_logprobs})
