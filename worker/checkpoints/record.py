"""`CheckpointRecord`: what one KV checkpoint of a job holds, and its msgpack codec.

A checkpoint is three blobs: a SEGMENT (the append-only rows since the previous checkpoint,
every blob's rows in one container), a FIXED blob (rings and compressor state, whole) and
this record. The record lists every segment from position 0 to its cursor, so the chain's
rows are each written once and shared. The record is msgpack wrapped with its own checksum;
never pickle (anyone who can write the store would get code execution in the worker).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field

from jobs.serializer import packb, unpackb

# Bumped when a field's meaning or the container layout changes.
RECORD_VERSION = 1
CHECKSUM = "blake2b-128"


class RecordError(ValueError):
    """A record's bytes are not a record: `reason` is ``checksum`` or ``layout``."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def checksum(data: bytes) -> str:
    """Hex blake2b-128 digest of `data` (``CHECKSUM``)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def pack_blobs(blobs: dict[str, bytes]) -> bytes:
    """A container of name -> bytes (msgpack map)."""
    return packb(blobs)


def unpack_blobs(data: bytes) -> dict[str, bytes]:
    """Inverse of `pack_blobs`. Raises ValueError when `data` is not such a container."""
    try:
        blobs = unpackb(data)
    except Exception as e:  # msgpack raises several unrelated types for bad bytes
        raise ValueError(f"blob container does not decode: {e}") from e
    if not isinstance(blobs, dict) or not all(
        isinstance(k, str) and isinstance(v, bytes) for k, v in blobs.items()
    ):
        raise ValueError("blob container is not a map of name -> bytes")
    return blobs


@dataclass(frozen=True)
class BlobRef:
    """A stored blob: its key, size in bytes and `checksum`.

    ``first`` and ``last`` are the token positions ``[first, last)`` a segment covers
    (0 for a fixed blob).
    """

    key: str
    nbytes: int
    checksum: str
    first: int = 0
    last: int = 0

    @classmethod
    def of(cls, key: str, data: bytes, first: int = 0, last: int = 0) -> BlobRef:
        return cls(key, len(data), checksum(data), first, last)

    def verify(self, data: bytes) -> bool:
        return len(data) == self.nbytes and checksum(data) == self.checksum


@dataclass(frozen=True)
class CheckpointRecord:
    """One checkpoint of a job at `cursor` tokens.

    Attributes:
        seq: 1, 2, ... in the order the job wrote them.
        chunk_plan: the job's chunk boundaries (end positions, tokens); `cursor` is one.
        model, model_sha256: the registry name and GGUF digest it was computed with.
        layout: the complete state's ``CacheState.meta`` at `cursor` (version, cache type,
            architecture, kv_dtype, shapes, position, capacity, ``since`` 0 and per-blob
            name, dtype, rows-first shape): everything but the bytes.
        segments: append-only segments in order, covering positions ``[0, cursor)``.
        fixed: this checkpoint's fixed blob.
        previous: record key of the checkpoint before this one, or None.
        written_at: UTC epoch seconds; with `ttl_s` (seconds), when its blobs expire.
    """

    job_id: str
    seq: int
    cursor: int
    chunk_plan: list[int]
    model: str
    model_sha256: str
    layout: dict
    segments: list[BlobRef]
    fixed: BlobRef
    previous: str | None = None
    written_at: float = 0.0
    ttl_s: int = 0
    version: int = RECORD_VERSION
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        total = sum(s.nbytes for s in self.segments) + self.fixed.nbytes
        object.__setattr__(self, "nbytes", total)

    @property
    def expires_at(self) -> float:
        return self.written_at + self.ttl_s

    def to_bytes(self) -> bytes:
        """msgpack ``{body, checksum}`` with the record's fields in `body`."""
        values = dataclasses.asdict(self)
        values.pop("nbytes")
        body = packb(values)
        return packb({"body": body, "checksum": checksum(body)})

    @classmethod
    def from_bytes(cls, data: bytes) -> CheckpointRecord:
        """Inverse of `to_bytes`.

        Raises:
            RecordError: reason ``checksum`` (bytes changed since written) or ``layout``
                (another record version, or fields that do not decode).
        """
        try:
            outer = unpackb(data)
            body, digest = outer["body"], outer["checksum"]
        except Exception as e:  # msgpack raises several unrelated types for bad bytes
            raise RecordError("checksum", f"record does not decode: {e}") from e
        if not isinstance(body, bytes) or checksum(body) != digest:
            raise RecordError("checksum", "record checksum mismatch")
        try:
            values = unpackb(body)
            if values.get("version") != RECORD_VERSION:
                raise RecordError("layout", f"record version {values.get('version')!r}, "
                                            f"this worker reads {RECORD_VERSION}")
            values["segments"] = [BlobRef(**s) for s in values["segments"]]
            values["fixed"] = BlobRef(**values["fixed"])
            return cls(**values)
        except RecordError:
            raise
        except Exception as e:
            raise RecordError("layout", f"record fields do not decode: {e}") from e
