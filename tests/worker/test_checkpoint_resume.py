"""Checkpoint resume is exact: a prefill checkpointed incrementally at several cursors and
resumed from each in a fresh process (a FileStore directory, the real redis-server) gives
bitwise the logits of the uninterrupted chunked prefill, and the one-pass contract.

Cursors (`checkpoint_helpers.CHECKPOINT_AT`) on both tiny models (16-token windows): rings
that have wrapped, boundaries off the windows, and deepseek4-tiny's ratio-4 and ratio-128
group edges (256) and insides (130, 203).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import redis

from jobs import keys
from tests.exactness import EXACT_RTOL, assert_contract
from worker.checkpoints.store import FileStore, RedisStore

from .checkpoint_helpers import (
    CHECKPOINT_AT,
    JOB,
    argmax_margin,
    checkpointed_prefill,
    chunked,
    one_pass,
    record_key,
)

ROOT = Path(__file__).resolve().parents[2]
MODELS = ["gemma3-tiny", "deepseek4-tiny"]
# Resumed (bitwise the chunked run) vs one pass as a fraction of max |logit|, float32 on
# CPU: measured 8.9e-7 (gemma3-tiny) and 3.6e-7 (deepseek4-tiny) at every cursor.
BOUND = 2e-6


def resume_in_fresh_process(name: str, pairs: list[tuple[str, str]], out: Path) -> list[dict]:
    """Run tests/worker/checkpoint_resume.py on (store URL, record key) pairs."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [f"{url}#{key}" for url, key in pairs]
    proc = subprocess.run([sys.executable, "-m", "tests.worker.checkpoint_resume", name,
                           str(out), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    for i, line in enumerate(lines):
        line["logits"] = np.frombuffer(Path(out, f"{i}.f32").read_bytes(), "<f4")
    return lines


def check_resumed(name: str, line: dict, cursor: int) -> float:
    assert line["cursor"] == cursor
    np.testing.assert_array_equal(line["logits"], chunked(name))
    assert argmax_margin(one_pass(name)) > 2 * EXACT_RTOL  # the argmax check means something
    return assert_contract(line["logits"], one_pass(name), BOUND)


@pytest.mark.parametrize("name", MODELS)
def test_resume_from_each_checkpoint_of_a_file_store(name, tmp_path):
    store = FileStore(tmp_path / "store")
    snapshots: list[tuple[str, str]] = []

    def snapshot(record):
        # only the latest two checkpoints stay whole: keep a copy of the store at each one
        copy = tmp_path / f"at-{record.cursor}"
        shutil.copytree(store.root, copy)
        snapshots.append((f"file://{copy}", record_key(record.seq)))

    records = checkpointed_prefill(name, store, after_each=snapshot)
    assert [r.cursor for r in records] == list(CHECKPOINT_AT)
    for before, after in zip(records, records[1:], strict=False):  # only the new rows
        assert after.segments[:-1] == before.segments
        new = after.segments[-1]
        assert (new.first, new.last) == (before.cursor, after.cursor)
    lines = resume_in_fresh_process(name, snapshots, tmp_path / "out")
    measured = [check_resumed(name, line, c) for line, c in zip(lines, CHECKPOINT_AT, strict=True)]
    print(name, "resumed vs one pass, x max|logit|:", [f"{m:.2g}" for m in measured])
    assert [line["chunks"] for line in lines] == [6, 4, 3, 2, 1]


@pytest.mark.parametrize("name", MODELS)
def test_resume_from_the_real_redis_server(name, redis_server, tmp_path):
    connection = redis.Redis.from_url(redis_server)
    connection.flushall()
    records = checkpointed_prefill(name, RedisStore(connection))
    latest, previous = records[-1], records[-2]
    # the latest two are whole; older ones kept their segments only
    live = {k.decode() for k in connection.keys(keys.PREFIX + ":{" + JOB + "}:ckpt:*")}
    assert latest.fixed.key in live and previous.fixed.key in live
    assert records[-3].fixed.key not in live and record_key(records[-3].seq) not in live
    assert {s.key for s in latest.segments} <= live
    pairs = [(redis_server, record_key(latest.seq)), (redis_server, record_key(previous.seq))]
    lines = resume_in_fresh_process(name, pairs, tmp_path / "out")
    for line, record in zip(lines, [latest, previous], strict=True):
        check_resumed(name, line, record.cursor)
