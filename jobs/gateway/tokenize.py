"""Tokenizer endpoints, so clients need no local tokenizer: ``POST /tokenize``,
``POST /detokenize`` and ``GET /tokenizer_info``, in the shapes vLLM's server answers and
lm-evaluation-harness's remote tokenizer reads (``lm_eval/utils.py``, ``RemoteTokenizer``
and ``check_remote_tokenizer_support``: ``{"prompt", "add_special_tokens"}`` ->
``{"tokens"}``, ``{"tokens"}`` -> ``{"prompt"}``, and an info object with ``eos_token``).

They use the tokenizer the model's workers published (`jobs.tokenizer.ServedTokenizer`), so
the ids are the ones a worker computes for the same text.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, ConfigDict

from ..defaults import DEFAULT_MODEL
from .body import documented, parsed
from .deps import Client, require_api_key

# Texts longer than this (characters) are tokenized on a thread, off the event loop.
INLINE_CHARS = 4096

router = APIRouter(dependencies=[Depends(require_api_key)])


class TokenizeRequest(BaseModel):
    """``add_special_tokens`` adds BOS as the model's GGUF says (False: never);
    ``parse_special`` matches control tokens written in the text (``<start_of_turn>``)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str = DEFAULT_MODEL
    prompt: str
    add_special_tokens: bool = True
    parse_special: bool = True


class DetokenizeRequest(BaseModel):
    """Control tokens (``<bos>``, ``<start_of_turn>``) give their text unless
    ``skip_special_tokens``, as transformers' ``decode``."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str = DEFAULT_MODEL
    tokens: list[int]
    skip_special_tokens: bool = False


@router.post("/tokenize", openapi_extra=documented(TokenizeRequest))
async def tokenize(req: Annotated[TokenizeRequest, Depends(parsed(TokenizeRequest))],
                   client: Client) -> dict:
    """``{"tokens": [int], "count": int, "max_model_len": int}``."""
    tokenizer = await client.tokenizer(req.model)
    add_bos = None if req.add_special_tokens else False

    def encode() -> list[int]:
        return tokenizer.encode(req.prompt, add_bos=add_bos, parse_special=req.parse_special)

    ids = encode() if len(req.prompt) <= INLINE_CHARS else await asyncio.to_thread(encode)
    info = (await client.models())[req.model]
    return {"tokens": ids, "count": len(ids), "max_model_len": info.context_length}


@router.post("/detokenize", openapi_extra=documented(DetokenizeRequest))
async def detokenize(req: Annotated[DetokenizeRequest, Depends(parsed(DetokenizeRequest))],
                     client: Client) -> dict:
    """``{"prompt": str}``; an id outside the vocabulary is a 400 ``TokenOutOfRange``."""
    tokenizer = await client.tokenizer(req.model)
    return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=req.skip_special_tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(client: Client, model: str = Query(DEFAULT_MODEL)) -> dict:
    """The special tokens and chat template (``eos_token``, ``bos_token``, ``pad_token``,
    ``chat_template``, ...) of `model`'s tokenizer."""
    tokenizer = await client.tokenizer(model)
    context = (await client.models())[model].context_length
    return {"model": model, **tokenizer.info(model_max_length=context)}
