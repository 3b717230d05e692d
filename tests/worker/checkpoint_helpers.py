"""Shared by the checkpoint tests: tiny models, a prompt and plan, a checkpointed prefill."""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from jobs import keys
from model.planner import ChunkPlan
from worker.checkpoints.record import CheckpointRecord
from worker.checkpoints.writer import CheckpointWriter

N_TOKENS = 300
# Unaligned to the 16-token windows; 37 and 203 are mid-ring after it wrapped, 130 is
# inside a ratio-4 and a ratio-128 group of deepseek4-tiny (ratios 0, 0, 4, 128, 4, 128),
# 256 is a ratio-128 (and ratio-4) group edge, 257 one past it.
BOUNDARIES = (5, 37, 64, 130, 203, 256, 257, N_TOKENS)
CHECKPOINT_AT = (37, 130, 203, 256, 257)
JOB = "job1"


@functools.cache
def loaded(name: str):
    from model.registry import load_model

    return load_model(name, dtype=mx.float32)


def prompt(name: str, n: int = N_TOKENS, seed: int = 5) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, loaded(name).vocab_size, n)]


def plan() -> ChunkPlan:
    return ChunkPlan.from_boundaries(N_TOKENS, BOUNDARIES)


@functools.cache
def one_pass(name: str) -> np.ndarray:
    one = ChunkPlan.from_boundaries(N_TOKENS, [N_TOKENS])
    return loaded(name).start_prefill(prompt(name), plan=one).run()


@functools.cache
def chunked(name: str) -> np.ndarray:
    return loaded(name).start_prefill(prompt(name), plan=plan()).run()


def record_key(seq: int, job_id: str = JOB) -> str:
    return keys.checkpoint(job_id, seq, "record")


def checkpointed_prefill(
    name: str,
    store,
    at=CHECKPOINT_AT,
    after_each: Callable[[CheckpointRecord], None] | None = None,
    ttl_s: int = 600,
) -> list[CheckpointRecord]:
    """Prefill `prompt(name)` on `plan()`, checkpointing (incrementally) at the cursors in
    `at`; `after_each(record)` runs once each checkpoint is written. Returns the records."""
    writer = CheckpointWriter(store, ttl_s=ttl_s)
    records: list[CheckpointRecord] = []
    prefill = loaded(name).start_prefill(prompt(name), plan=plan())
    try:
        while not prefill.done:
            prefill.step()
            if prefill.cursor in at:
                previous = records[-1] if records else None
                assert writer.submit(JOB, len(records) + 1, prefill, loaded(name), previous,
                                     records.append)
                writer.wait()
                assert writer.last_error is None, writer.last_error
                if after_each is not None:
                    after_each(records[-1])
    finally:
        writer.close()
    np.testing.assert_array_equal(prefill.logits(), chunked(name))
    return records


def argmax_margin(logits: np.ndarray) -> float:
    top = np.sort(logits)[-2:]
    return float(top[1] - top[0]) / float(np.abs(logits).max())
