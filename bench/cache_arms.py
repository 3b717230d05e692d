"""What `bench.prefix` and `bench.system_prompt` share: a worker's prefix cache off against
on, the arms alternating over rounds on one redis-server, each arm a fresh set of
``prefillq worker`` processes (and whatever else the benchmark starts) on a flushed Redis.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from worker.redis_server import RedisServer

from .common import Recorder, log

MODEL = "gemma3-tiny"
DEFAULT_CACHE_BYTES = 1 << 30

Run = TypeVar("Run")


def add_arm_flags(p: argparse.ArgumentParser) -> None:
    """The flags both benchmarks take: ``--model``, ``--rounds``, ``--prefix-cache-bytes``,
    ``--seed`` and ``--logs``."""
    p.add_argument("--model", default=MODEL,
                   help=f"a registry name or NAME=/path.gguf (default {MODEL})")
    p.add_argument("--rounds", type=int, default=1, help="rounds of both arms (default 1)")
    p.add_argument("--prefix-cache-bytes", type=int, default=DEFAULT_CACHE_BYTES,
                   help=f"the cache-on arm's budget (default {DEFAULT_CACHE_BYTES})")
    p.add_argument("--seed", type=int, default=0, help="the workload's seed (default 0)")
    p.add_argument("--logs", type=Path, metavar="DIR",
                   help="keep the processes' logs here (default: discarded)")


def served_name(model: str) -> str:
    """The name requests give: a worker started with ``--model NAME=/path.gguf`` serves
    NAME."""
    return model.partition("=")[0]


def vocab_size(model: str) -> int:
    """The model's vocabulary size, for random token ids; 0 for the tiny default, whose
    workloads draw from `bench.load.TOKEN_IDS` (its text pieces) instead."""
    if model == MODEL:
        return 0
    from model.registry import load_model

    return load_model(model).vocab_size


def alternate(args: argparse.Namespace,
              run_arm: Callable[[RedisServer, str, int, int, Path], Run],
              extra: Sequence[tuple[str, int]] = ()) -> list[Run]:
    """Run ``off`` (cache 0 bytes), ``on`` (``args.prefix_cache_bytes``) and the `extra`
    ``(name, cache bytes)`` arms each round, in reverse order in odd rounds, as
    ``run_arm(server, name, round, cache_bytes, logs)``; the runs in the order they ran."""
    runs = []
    with RedisServer() as server, tempfile.TemporaryDirectory() as scratch:
        logs = args.logs or Path(scratch)
        logs.mkdir(parents=True, exist_ok=True)
        for round_ in range(args.rounds):
            arms = [("off", 0), ("on", args.prefix_cache_bytes), *extra]
            for name, cache_bytes in arms if round_ % 2 == 0 else arms[::-1]:
                runs.append(run_arm(server, name, round_, cache_bytes, logs))
    return runs


def log_bounds(rec: Recorder) -> None:
    """Log each floor or ceiling held or missed (a missed bound is a measurement: the
    benchmark still exits 0)."""
    for line in rec.bounds_report():
        log(line)
