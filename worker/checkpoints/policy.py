"""When a worker checkpoints a resident job (``--checkpoint-every``); no MLX here, so the
CLI can check the option before any model loads."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Every 2 s: on a CPU, where a 2,048-token chunk takes seconds, that is every chunk; on a GPU
# one checkpoint per many chunks, so its cost (the copy out on the chunk loop, the write on
# the writer's thread) stays well under the benchmark floors, and a killed job loses at most
# 2 s and a chunk. docs/checkpoints.md has the measurements.
DEFAULT_CHECKPOINT_EVERY = "2s"


@dataclass(frozen=True)
class CheckpointPolicy:
    """How often a resident job is checkpointed: every `chunks` chunks, or once `seconds`
    have passed since its last checkpoint (checked after each chunk)."""

    chunks: int | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, text: str) -> CheckpointPolicy | None:
        """``"4"`` (chunks), ``"30s"`` (seconds), or ``"none"`` (None: no checkpoints).

        Raises:
            ValueError: anything else, or a count or duration that is not positive.
        """
        text = text.strip().lower()
        if text == "none":
            return None
        match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*s", text)
        if match:
            seconds = float(match.group(1))
            if seconds <= 0:
                raise ValueError(f"{text!r}: want a positive duration")
            return cls(seconds=seconds)
        if text.isdigit() and int(text) > 0:
            return cls(chunks=int(text))
        raise ValueError(f"{text!r}: want N >= 1 (chunks), Ns > 0 (seconds) or none")

    def due(self, chunks_since: int, seconds_since: float) -> bool:
        if self.chunks is not None:
            return chunks_since >= self.chunks
        return seconds_since >= (self.seconds or 0.0)


def check_store_url(url: str) -> str:
    """``--checkpoint-store``'s value, checked before any model loads: ``redis`` (the
    queue's own Redis), ``redis://``, ``rediss://``, ``unix://`` or ``file:///abs/path``.

    Raises:
        ValueError: another scheme, or a file URL with a host or a relative path.
    """
    from urllib.parse import urlparse

    from jobs.client import redacted

    parsed = urlparse(url)
    if url == "redis" or parsed.scheme in ("redis", "rediss", "unix"):
        return url
    local = parsed.netloc in ("", "localhost") and parsed.path.startswith("/")
    if parsed.scheme == "file" and local:
        return url
    raise ValueError(f"checkpoint store {redacted(url)!r}: want redis (this queue's), "
                     "redis://..., or file:///absolute/path")
