"""Killing a child process in the middle of writing a file, for the kill-safety tests."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path


def kill_once_present(child: subprocess.Popen, path: Path, timeout_s: float = 60) -> None:
    """SIGKILLs `child` as soon as `path` exists (polled every millisecond) and reaps it.

    Asserts that the kill is what ended it, not the child finishing first.
    """
    deadline = time.monotonic() + timeout_s
    while not path.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL, "the child finished before it could be killed"
