"""Shared pieces: prompts, timing, the JSON-line record."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "data" / "gemma3-270m-llamacpp.json"


def prompt_ids(n: int) -> list[int]:
    """`n` real Gemma 3 token ids: BOS, then the 6,144-token reference prompt, tiled."""
    body = json.loads(REFERENCE.read_text())["cases"][-1]["tokens"][1:]
    reps = -(-(n - 1) // len(body))
    return [2, *(body * reps)[: n - 1]]


def timed(fn: Callable[[], object], repeats: int = 1) -> tuple[float, object]:
    """Fastest wall seconds of `repeats` calls, and the last call's result.

    The minimum, not the median: on a shared 2-core machine noise only ever adds time.
    """
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def interleaved(*fns: Callable[[], object], repeats: int) -> list[float]:
    """Fastest seconds of each of `fns`, run in turn (a, b, c, a, b, c, ...) so drift in the
    machine's speed hits all alike."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, seconds in zip(fns, times, strict=True):
            seconds.append(timed(fn)[0])
    return [min(seconds) for seconds in times]


class Recorder:
    """Prints one JSON line per measurement (``--json``) or a readable line, and keeps them."""

    def __init__(self, as_json: bool, context: dict):
        self.as_json, self.context, self.records = as_json, context, []

    def __call__(self, metric: str, value: float, unit: str, **details) -> dict:
        record = {"metric": metric, "value": round(value, 4), "unit": unit, **details}
        self.records.append(record)
        if self.as_json:
            print(json.dumps(record), flush=True)
        else:
            extra = ", ".join(f"{k}={v}" for k, v in details.items())
            print(f"{metric:>28} = {value:10.4g} {unit}  ({extra})", flush=True)
        return record


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
