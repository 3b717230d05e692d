"""Shared pieces: prompts, timing, the JSON-line record."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
REFERENCE = DATA / "gemma3-270m-llamacpp.json"
# Each real model's llama.cpp reference, whose longest prompt is tiled into bench prompts,
# and the BOS id it starts with (None: the model adds none).
REFERENCES = {"gemma3-270m": (REFERENCE, 2),
              "smollm2-135m": (DATA / "smollm2-135m-llamacpp.json", None)}


def prompt_ids(n: int, model: str = "gemma3-270m") -> list[int]:
    """`n` real token ids of `model` (a key of `REFERENCES`): its BOS if it has one, then
    the longest prompt of its llama.cpp reference (~6,100 tokens of the same text for
    each), tiled. Raises KeyError for a model without a reference."""
    path, bos = REFERENCES[model]
    body = json.loads(path.read_text())["cases"][-1]["tokens"]
    head = [] if bos is None else [bos]
    body = body[len(head):]
    reps = -(-(n - len(head)) // len(body))
    return [*head, *(body * reps)[: n - len(head)]]


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


def interleaved(*fns: Callable[[], float], repeats: int) -> list[float]:
    """Fastest of each of `fns`, run in turn, reversing the order every other round (a, b,
    c, c, b, a, a, b, c, ...), so that drift in the machine's speed hits all alike and no fn
    always inherits the state (heap, caches) the same other fn left behind. Each fn
    returns the seconds it measured itself (wrap a plain callable in `timed`), so one can
    leave out its own set-up."""
    times: list[list[float]] = [[] for _ in fns]
    order = list(range(len(fns)))
    for round_ in range(repeats):
        for i in order if round_ % 2 == 0 else order[::-1]:
            times[i].append(fns[i]())
    return [min(seconds) for seconds in times]


class Recorder:
    """Prints one JSON line per measurement (``--json``) or a readable line, and keeps them.

    A measurement with a bound (``floor=`` or ``ceiling=`` among its details) also gets
    ``"holds": true|false``; `bounds_report` lists the ones that did not hold.
    """

    def __init__(self, as_json: bool, context: dict, out: Path | None = None,
                 tags: dict | None = None):
        """`out`, if given, gets ``{"context": ...}`` and then every record, a JSON line
        each (the files under ``bench/results/``). `tags` go on every record after its
        unit (which process made it, say); a detail of the same name replaces a tag."""
        self.as_json, self.context, self.records = as_json, context, []
        self.out, self.tags = out, dict(tags or {})
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"context": context}) + "\n")

    def __call__(self, metric: str, value: float, unit: str, **details) -> dict:
        record = {"metric": metric, "value": round(value, 4), "unit": unit, **self.tags,
                  **details}
        if "floor" in details:
            record["holds"] = value >= details["floor"]
        elif "ceiling" in details:
            record["holds"] = value <= details["ceiling"]
        self.records.append(record)
        if self.out is not None:
            with self.out.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if self.as_json:
            print(json.dumps(record), flush=True)
        else:
            extra = ", ".join(f"{k}={v}" for k, v in details.items())
            print(f"{metric:>28} = {value:10.4g} {unit}  ({extra})", flush=True)
        return record

    def bounds_report(self) -> list[str]:
        """One line per bounded measurement: ``holds`` or ``MISSED`` with value and bound."""
        lines = []
        for r in self.records:
            if "holds" in r:
                bound = f">= {r['floor']}" if "floor" in r else f"<= {r['ceiling']}"
                verdict = "holds " if r["holds"] else "MISSED"
                lines.append(f"{verdict} {r['metric']} = {r['value']:.3g} (want {bound})")
        return lines


def causal_attention_flops(queries: int, heads: int, head_dim: int) -> float:
    """FLOPs of causal self-attention over `queries` tokens: QK^T and PV, each 2 FLOPs a
    multiply-add, over the half of the ``queries x queries`` scores a causal mask keeps."""
    return 2 * 2 * (queries * queries / 2) * head_dim * heads


def bench_parser(prog: str, description: str | None, *, json_lines: bool = True
                 ) -> argparse.ArgumentParser:
    """A bench CLI's parser: its module docstring as written, and the results options every
    bench takes: ``--out FILE`` (see `refuse_existing`) and, with `json_lines`, ``--json``
    (a bench without it always prints JSON lines)."""
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if json_lines:
        p.add_argument("--json", action="store_true",
                       help="one JSON line per measurement (default: aligned text lines)")
    p.add_argument("--out", type=Path, metavar="FILE",
                   help="also write the context and every record here, one JSON line each")
    return p


def refuse_existing(parser: argparse.ArgumentParser, out: Path | None) -> None:
    """End the run (``parser.error``, exit status 2) if results file `out` already exists:
    results are never overwritten."""
    if out is not None and out.exists():
        parser.error(f"--out {out} exists; results files are never overwritten")


def load_or_exit(parser: argparse.ArgumentParser, name: str):
    """`model.registry.load_model(name)`, after checking ``$PREFILLQ_CPU_STREAMS``; a bad
    name or setting ends the run with one line (``parser.error``, exit status 2) instead of
    a traceback."""
    from model.registry import ModelNotFound, load_model
    from model.runtime.streams import cpu_streams

    try:
        cpu_streams()
        return load_model(name)
    except (ModelNotFound, ValueError) as e:
        parser.error(str(e.args[0]) if e.args else str(e))


def git_commit() -> str:
    """The checkout's short commit id (empty outside a git checkout), for a results file's
    context line."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def machine_context(suite: str, redis: bool = False) -> dict:
    """The start of a results file's context line: date, commit, machine, 1-minute load
    average, `suite`, and with `redis` the ``redis-server --version`` the run used."""
    context = {"date": datetime.date.today().isoformat(), "commit": git_commit(),
               "machine": f"{os.uname().machine}, {os.cpu_count()} cores",
               "load_average_1m": round(os.getloadavg()[0], 2)}
    if redis:
        context["redis"] = subprocess.run(["redis-server", "--version"], capture_output=True,
                                          text=True).stdout.strip()
    return context | {"suite": suite}


@contextmanager
def patched(obj, name: str, value):
    """``obj.name = value`` for the block, the old value restored on exit (benchmarks that
    take a part of the product away; tests use pytest's monkeypatch)."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
