"""prefillq client library and Redis schema. Never imports MLX.

    from jobs import PrefillClient
    client = PrefillClient.from_url("redis://localhost:6379/0")
    job_id = client.submit(prompt="The capital of France is", model="gemma3-270m")
    print(client.result(job_id, timeout=60).top_k[0].piece)

`AsyncPrefillClient` is its asyncio twin (redis.asyncio): the same methods, awaited.
"""

from .aio import AsyncPrefillClient
from .client import PrefillClient
from .errors import (
    CorruptJob,
    EmptyPrompt,
    InvalidRequest,
    JobCanceled,
    JobFailed,
    JobNotFound,
    JobTimeout,
    PrefillQError,
    PromptTooLarge,
    PromptTooLong,
    QueueFull,
    TokenizerMalformed,
    TokenizerUnavailable,
    TokenOutOfRange,
    UnknownModel,
)
from .limits import Limits
from .result import ContinuationResult, PrefillResult, TopLogit
from .schema import JobState, JobStatus, LogitsMode
from .tokenizer import ServedTokenizer

__all__ = [
    "AsyncPrefillClient",
    "ContinuationResult",
    "CorruptJob",
    "EmptyPrompt",
    "InvalidRequest",
    "JobCanceled",
    "JobFailed",
    "JobNotFound",
    "JobState",
    "JobStatus",
    "JobTimeout",
    "Limits",
    "LogitsMode",
    "PrefillClient",
    "PrefillQError",
    "PrefillResult",
    "PromptTooLarge",
    "PromptTooLong",
    "QueueFull",
    "ServedTokenizer",
    "TokenizerMalformed",
    "TokenizerUnavailable",
    "TokenOutOfRange",
    "TopLogit",
    "UnknownModel",
]
