"""model.gguf.store.build_once and the cached tiny models: built once under a lock, renamed
into place whole, rebuilt when invalid."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from model.gguf.reader import file_sha256, read_gguf
from model.gguf.store import CACHE_DIR_ENV, build_once
from model.gguf.synthetic import (
    GEMMA3_TINY_NAME,
    tiny_gemma3_path,
    write_tiny_deepseek4,
    write_tiny_gemma3,
)

ROOT = Path(__file__).resolve().parents[2]
PAYLOAD = b"x" * 100_000


def _slow_build(log: Path):
    def build(partial: Path) -> None:
        with log.open("a") as f:
            f.write(f"start {os.getpid()}\n")
        partial.write_bytes(PAYLOAD[: len(PAYLOAD) // 2])
        time.sleep(0.2)  # a slow writer: others arrive while it holds the lock
        partial.write_bytes(PAYLOAD)
        with log.open("a") as f:
            f.write(f"end {os.getpid()}\n")

    return build


def _is_payload(path: Path) -> bool:
    return path.read_bytes() == PAYLOAD


def _child(code: str, **env: str) -> subprocess.Popen:
    """`code` in a fresh interpreter with this checkout importable."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True
    )


def test_concurrent_callers_build_once_and_all_see_the_whole_file(tmp_path):
    target, log = tmp_path / "f.bin", tmp_path / "builds.log"
    code = (
        "from pathlib import Path; from model.gguf.store import build_once; "
        "from tests.model.test_gguf_store import _slow_build, _is_payload; "
        f"build_once(Path({str(target)!r}), _slow_build(Path({str(log)!r})), _is_payload)"
    )
    children = [_child(code) for _ in range(4)]
    for child in children:
        child.communicate(timeout=60)
    assert [child.returncode for child in children] == [0] * 4
    assert len(log.read_text().splitlines()) == 2  # one start, one end
    assert target.read_bytes() == PAYLOAD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["builds.log", "f.bin", "f.bin.lock"]


def test_a_failed_build_leaves_the_old_file_and_no_partial(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")

    def failing(partial: Path) -> None:
        partial.write_bytes(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        build_once(target, failing, _is_payload)
    assert target.read_bytes() == b"old"
    assert not (tmp_path / "f.bin.partial").exists()


def test_a_leftover_partial_file_is_overwritten(tmp_path):
    target = tmp_path / "f.bin"
    (tmp_path / "f.bin.partial").write_bytes(b"garbage from a killed builder" * 10_000)
    build_once(target, lambda partial: partial.write_bytes(PAYLOAD), _is_payload)
    assert target.read_bytes() == PAYLOAD and not (tmp_path / "f.bin.partial").exists()


def test_a_truncated_tiny_model_is_rewritten(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    reference = write_tiny_gemma3(tmp_path / "reference.gguf")
    path = tmp_path / "gemma3-tiny-seed0.gguf"
    path.write_bytes(reference.read_bytes()[:1000])
    assert tiny_gemma3_path() == (path, file_sha256(reference))
    assert read_gguf(path).metadata["general.name"] == GEMMA3_TINY_NAME


def test_tiny_models_written_by_two_processes_at_once_are_whole(tmp_path):
    code = (
        "from model.gguf.synthetic import tiny_deepseek4_path, tiny_gemma3_path; "
        "print(tiny_gemma3_path()[1], tiny_deepseek4_path()[1])"
    )
    children = [_child(code, **{CACHE_DIR_ENV: str(tmp_path)}) for _ in range(2)]
    outputs = [child.communicate(timeout=120)[0].split() for child in children]
    assert [child.returncode for child in children] == [0, 0]
    gemma = file_sha256(write_tiny_gemma3(tmp_path / "reference-g.gguf"))
    deepseek = file_sha256(write_tiny_deepseek4(tmp_path / "reference-d.gguf"))
    assert outputs == [[gemma, deepseek]] * 2
    assert file_sha256(tmp_path / "gemma3-tiny-seed0.gguf") == gemma
    assert file_sha256(tmp_path / "deepseek4-tiny-seed0.gguf") == deepseek
    assert not list(tmp_path.glob("*.partial"))
