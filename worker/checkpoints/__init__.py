"""KV checkpoints: a job's cache written incrementally to a shared store and restored by any
worker (DESIGN.md §9; docs/checkpoints.md).

- `checkpointing`: `Checkpointing`, when a worker checkpoints its resident jobs, and resume.
- `policy`: ``--checkpoint-every`` and ``--checkpoint-store``, checked before MLX loads.
- `store`: where blobs live (`open_store`: the queue's Redis, another Redis, a directory).
- `record`: what a checkpoint holds (`CheckpointRecord`), msgpack with checksums.
- `writer`: `CheckpointWriter`, copying between chunks and writing on a background thread.
- `restore`: `load`, `latest_usable` (falls back one checkpoint, else None) and `delete_all`.
- `sessions`: `SessionCheckpoints`, a finished session turn's slot for any worker.

The package imports nothing itself, so the CLI reads `policy` without importing MLX.
"""
