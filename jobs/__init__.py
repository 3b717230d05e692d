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
from .result import PrefillResult, TopLogit
from .schema import JobState, JobStatus, LogitsMode
from .tokenizer import ServedTokenizer

__all__ = [
    "AsyncPrefillClient",
    "CorruptJob",
    "EmptyPrompt",
    "Limits",
    "PromptTooLarge",
    "PromptTooLong",
    "InvalidRequest",
    "JobCanceled",
    "JobFailed",
    "JobNotFound",
    "JobState",
    "JobStatus",
    "JobTimeout",
    "LogitsMode",
    "PrefillClient",
    "PrefillQError",
    "PrefillResult",
    "QueueFull",
    "ServedTokenizer",
    "TokenizerMalformed",
    "TokenizerUnavailable",
    "TokenOutOfRange",
    "TopLogit",
    "UnknownModel",
]
