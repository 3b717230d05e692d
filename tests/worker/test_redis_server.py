"""`worker.redis_server.RedisServer`: a throwaway server that does not outlive the process
that started it, even when that process is killed before its cleanup runs."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from worker.redis_server import RedisServer, _dies_with_this_process

ROOT = Path(__file__).resolve().parents[2]


def _gone(pid: int) -> bool:
    """Whether `pid` has exited (gone, or a zombie nobody has reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


@pytest.mark.skipif(sys.platform != "linux" or not _dies_with_this_process(["x"])[1:],
                    reason="the parent-death signal needs Linux and util-linux's setpriv")
def test_a_killed_owner_leaves_no_server_behind():
    owner = subprocess.Popen(
        [sys.executable, "-c", "import time; from worker.redis_server import RedisServer; "
         "s = RedisServer().start(); print(s.proc.pid, flush=True); time.sleep(60)"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(owner.stdout.readline())
        assert not _gone(pid)   # the server runs while its owner does
        owner.kill()            # SIGKILL: no finalizer, no __exit__
        owner.wait(timeout=10)
        deadline = time.monotonic() + 5
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(pid)
    finally:
        owner.kill()


def test_a_server_started_off_the_main_thread_runs_as_is():
    # the signal would follow the starting thread, so none is asked for there
    got = []
    thread = threading.Thread(target=lambda: got.append(_dies_with_this_process(["a"])))
    thread.start()
    thread.join()
    assert got == [["a"]]


def test_the_server_still_answers_and_stops():
    with RedisServer() as server:
        assert redis.Redis.from_url(server.url).ping()
        pid = server.proc.pid
    assert _gone(pid)
