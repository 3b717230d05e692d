"""KV checkpoints: a job's cache written incrementally to a shared store and restored by any
worker (docs/checkpoints.md).

`checkpointing` decides when and resumes, `policy` checks the flags, `store`, `record`,
`writer` and `restore` write and read the blobs, `sessions` keeps a finished session turn.
The package imports nothing itself, so the CLI reads `policy` without importing MLX.
"""
