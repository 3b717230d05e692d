"""Where KV checkpoints live: the queue's Redis (default), another Redis, or a shared directory.

One small interface (`CheckpointStore`) so an S3-compatible store can be added later. Keys
are `jobs.keys.checkpoint` keys; values are opaque bytes with a TTL in seconds.
"""

from __future__ import annotations

import os
import struct
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol
from urllib.parse import quote, unquote, urlparse

import redis

from jobs.client import redacted

from .policy import check_store_url

# File store header: magic, then the expiry as float64 UTC epoch seconds (big-endian).
_MAGIC = b"PQCKPT1\n"
_HEADER = struct.Struct(">d")
_HEADER_BYTES = len(_MAGIC) + _HEADER.size
_SUFFIX = ".ckpt"
_TEMP_PREFIX = ".tmp-"
# A temp file this old is a writer that died mid-write: `sweep` removes it.
STALE_TEMP_S = 3600


class CheckpointStore(Protocol):
    """Blobs by key with a TTL. ``get`` of a missing or expired key is None."""

    def put(self, key: str, data: bytes, ttl_s: int) -> None: ...

    def get(self, key: str) -> bytes | None: ...

    def touch(self, keys: Sequence[str], ttl_s: int) -> None: ...

    def delete(self, keys: Sequence[str]) -> None: ...

    def sweep(self) -> int: ...


def _check_ttl(ttl_s: int) -> int:
    if int(ttl_s) < 1:
        raise ValueError(f"checkpoint TTL must be >= 1 s, got {ttl_s}")
    return int(ttl_s)


class RedisStore:
    """Checkpoint blobs as Redis strings (``SET key EX ttl``); Redis expires them itself.

    Args:
        connection: a ``redis.Redis`` (the queue's own, or one from `open_store`).
    """

    def __init__(self, connection: redis.Redis):
        self.redis = connection

    def put(self, key: str, data: bytes, ttl_s: int) -> None:
        """Raises ValueError for a TTL < 1 s, and whatever Redis raises (e.g. OOM)."""
        self.redis.set(key, data, ex=_check_ttl(ttl_s))

    def get(self, key: str) -> bytes | None:
        return self.redis.get(key)

    def touch(self, keys: Sequence[str], ttl_s: int) -> None:
        """Give every existing key in `keys` a fresh TTL of `ttl_s` seconds."""
        ttl_s = _check_ttl(ttl_s)
        if keys:
            pipe = self.redis.pipeline(transaction=False)
            for key in keys:
                pipe.expire(key, ttl_s)
            pipe.execute()

    def delete(self, keys: Sequence[str]) -> None:
        # one job's keys share its hash tag: a multi-key DEL stays in one cluster slot
        if keys:
            self.redis.delete(*keys)

    def sweep(self) -> int:
        """Nothing to do: Redis expires keys itself."""
        return 0


class FileStore:
    """One file per key under `root` (a directory every worker shares: NFS, a volume).

    The file name is the key percent-encoded (no ``/``, so no path escapes `root`) plus
    ``.ckpt``; the file starts with a magic line and the expiry (UTC epoch seconds). Writes
    go to a temp file that ``os.replace`` renames into place, so a reader sees a whole blob
    or none. Expired files read as missing; `sweep` deletes them.

    Args:
        root: an absolute directory, created if missing.
    Raises:
        ValueError: `root` is relative.
    """

    def __init__(self, root: Path | str):
        self.root = Path(root)
        if not self.root.is_absolute():
            raise ValueError(f"file store root {root} is not an absolute path")
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        if not key:
            raise ValueError("empty checkpoint key")
        return self.root / (quote(key, safe="") + _SUFFIX)

    def put(self, key: str, data: bytes, ttl_s: int) -> None:
        """Raises ValueError for a TTL < 1 s, OSError when the directory refuses the write."""
        header = _MAGIC + _HEADER.pack(time.time() + _check_ttl(ttl_s))
        temp = self.root / f"{_TEMP_PREFIX}{uuid.uuid4().hex}"
        try:
            with open(temp, "wb") as f:
                f.write(header)
                f.write(data)
            os.replace(temp, self.path(key))
        finally:
            temp.unlink(missing_ok=True)

    def get(self, key: str) -> bytes | None:
        try:
            data = self.path(key).read_bytes()
        except FileNotFoundError:
            return None
        expires = _expiry(data[:_HEADER_BYTES])
        if expires is None or expires <= time.time():
            return None
        return data[_HEADER_BYTES:]

    def touch(self, keys: Sequence[str], ttl_s: int) -> None:
        """Rewrite the expiry of every existing key in `keys` to now + `ttl_s` seconds."""
        header = _HEADER.pack(time.time() + _check_ttl(ttl_s))
        for key in keys:
            try:
                with open(self.path(key), "r+b") as f:
                    if f.read(len(_MAGIC)) == _MAGIC:
                        f.write(header)
            except FileNotFoundError:
                pass

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.path(key).unlink(missing_ok=True)

    def sweep(self) -> int:
        """Delete expired (or unreadable) blobs and stale temp files; returns how many."""
        removed, now = 0, time.time()
        for path in self.root.iterdir():
            try:
                if path.name.startswith(_TEMP_PREFIX):
                    stale = path.stat().st_mtime + STALE_TEMP_S <= now
                elif path.name.endswith(_SUFFIX):
                    with open(path, "rb") as f:
                        expires = _expiry(f.read(_HEADER_BYTES))
                    stale = expires is None or expires <= now
                else:
                    continue
                if stale:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:  # another worker swept it first
                continue
        return removed

    def keys(self) -> list[str]:
        """Every key with a file (expired or not), for tests and operators."""
        return sorted(unquote(p.name[: -len(_SUFFIX)]) for p in self.root.glob("*" + _SUFFIX))


def _expiry(header: bytes) -> float | None:
    if len(header) < _HEADER_BYTES or not header.startswith(_MAGIC):
        return None
    return _HEADER.unpack(header[len(_MAGIC) :])[0]


def open_store(url: str | None, connection: redis.Redis) -> CheckpointStore:
    """The store a ``--checkpoint-store`` URL names.

    Args:
        url: None or ``redis``: the queue's own Redis (`connection`); ``redis://``,
            ``rediss://`` or ``unix://`` URLs: that Redis; ``file:///abs/path``: a
            `FileStore` there.
        connection: the queue's Redis connection.
    Raises:
        ValueError: any other URL, or a file URL with a host or a relative path.
    """
    if url is None or check_store_url(url) == "redis":
        return RedisStore(connection)
    parsed = urlparse(url)
    if parsed.scheme == "file":
        try:
            return FileStore(Path(unquote(parsed.path)))
        except OSError as e:
            raise ValueError(f"checkpoint store {redacted(url)!r}: {e.strerror}") from e
    return RedisStore(redis.Redis.from_url(url))
