"""GGUF files built on first use (assembled from a package, or generated) and kept on disk.

`build_once` builds a file at most once across processes, and a killed builder leaves no
partial file at the final path.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_DIR_ENV = "PREFILLQ_CACHE_DIR"


def cache_dir() -> Path:
    """Where generated models live: ``$PREFILLQ_CACHE_DIR`` or ``~/.cache/prefillq`` (created)."""
    base = os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "prefillq"
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


def build_once(
    target: Path, build: Callable[[Path], object], is_valid: Callable[[Path], bool]
) -> Path:
    """`target`, built first when it is missing or `is_valid` rejects it.

    The file is built under an exclusive ``flock`` on ``<name>.lock`` into
    ``<name>.partial`` beside it and renamed into place once complete (``os.replace`` is
    atomic within one file system), so the path holds nothing, an older file or a whole new
    one whatever happens to the builder: concurrent first starts build it once, the kernel
    drops a killed holder's lock, and the next builder truncates its partial file. A file
    that exists but is not valid is rebuilt with a warning.

    Args:
        target: the file's final path; its directory is created if needed.
        build: writes the complete file at the path it is given (``<target>.partial``),
            overwriting whatever is there, and raises if it cannot.
        is_valid: whether a complete file at a path is the right one (e.g. its sha256).
    Returns:
        `target`.
    Raises:
        whatever `build` raises (the partial file is then removed); OSError when the
        directory, lock file or rename fails.
    """
    if target.exists() and is_valid(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    # "a" creates the lock file without truncating one another process holds open
    with open(target.with_name(target.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes or the process dies
        if target.exists():
            if is_valid(target):  # another process built it while this one waited
                return target
            log.warning("%s is incomplete or out of date; rebuilding it", target)
        try:
            build(partial)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    return target
