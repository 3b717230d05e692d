"""KV checkpoints: a job's cache written incrementally to a shared store and restored by any
worker (DESIGN.md §9).

- `store`: where blobs live (`open_store`: the queue's Redis, another Redis, a directory).
- `record`: what a checkpoint holds (`CheckpointRecord`), msgpack with checksums.
- `writer`: `CheckpointWriter`, copying between chunks and writing on a background thread.
- `restore`: `load`, `latest_usable` (falls back one checkpoint, else None) and `delete_all`.
"""

from .record import CheckpointRecord, checksum
from .restore import CheckpointUnusable, delete_all, latest_usable, load
from .store import CheckpointStore, FileStore, RedisStore, open_store
from .writer import CheckpointWriter

__all__ = [
    "CheckpointRecord",
    "CheckpointStore",
    "CheckpointUnusable",
    "CheckpointWriter",
    "FileStore",
    "RedisStore",
    "checksum",
    "delete_all",
    "latest_usable",
    "load",
    "open_store",
]
