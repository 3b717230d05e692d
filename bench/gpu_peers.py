"""The peers `python -m bench.gpu` measures beside prefillq, each in a process of its own.

A peer shares its process with nothing (torch picks a slower attention backend once MLX has
used the GPU in its process): `plan` and `attention_plan` name one ``python -m`` child per
peer and backend, `run_all` runs them and reads back their records. This module imports
neither MLX nor torch: both sides of the protocol use it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

from .common import Recorder, log

# mlx-lm's module for each family a `shapes_of` names; its records' impl is "mlx-lm MODULE"
MLX_LM_MODULES = {"gemma3": "gemma3_text", "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
MLX_LM = "mlx-lm gemma3_text"
HF_SDPA, HF_FLEX, HF_EAGER = ("transformers sdpa", "transformers flex_attention",
                              "transformers eager")
TORCH_SDPA = "torch sdpa"
BEST = " best"  # the impl of a best-backend record: "torch sdpa best"
# torch's own pick, no `sdpa_kernel` context; recorded, never a best (its name is a guess)
DEFAULT_BACKEND = "default"
# our name -> torch.nn.attention.SDPBackend member
SDPA_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION",
                 "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
# One pass of 32K tokens takes ~0.1-0.7 s on an H200, and torch's timings vary less than
# MLX's host-side graph building, so 3 runs after the warm-up one.
HF_REPEATS = 3
# Characters of an error (or of a child's stderr) kept on its record: an OOM runs long.
ERROR_CHARS = 400
# A child's wall-clock limit: flex_attention's compiles at two lengths take the longest.
CHILD_TIMEOUT_S = 300
ROOT = Path(__file__).resolve().parents[1]

# MLX's own CUDA graph knobs (mlx/backend/cuda, v0.32). Importing `model` sets prefillq's
# (`model.runtime.cuda_graphs`) process-wide, so mlx-lm's child runs with these: each side
# is measured as it ships.
MLX_GRAPH_DEFAULTS = {"MLX_MAX_OPS_PER_BUFFER": "20", "MLX_CUDA_GRAPH_CACHE_SIZE": "100"}


# ---- the child's side ----------------------------------------------------------------

def process_label(impl: str, backend: str | None = None) -> str:
    """A peer process's name, every one of its records' ``process``: the impl it runs and
    the SDPA backend it is held to, if any."""
    return impl if backend is None else f"{impl}, backend {backend}"


def child_recorder(process: str, backend: str | None = None) -> Recorder:
    """A child's `Recorder`: JSON lines on stdout, each tagged with this process's pid,
    `process` (its label) and `backend`."""
    return Recorder(True, {}, tags={"pid": os.getpid(), "process": process,
                                    "backend": backend})


def measure(rec: Recorder, metric: str, unit: str, work: float,
            seconds: Callable[[], float], **details) -> dict | None:
    """Record ``work / seconds()`` as `metric`, or a ``peer_error`` record (value 0, with
    the error and the first warnings it raised: torch says there why a backend declined)
    if ``seconds()`` raised. Returns the record, or None after an error."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            s = seconds()
        except Exception as error:  # one backend's refusal or OOM must not end the child
            why = [str(w.message)[:ERROR_CHARS] for w in caught[:4]]
            rec("peer_error", 0.0, "none", for_metric=metric,
                error=f"{type(error).__name__}: {error}"[:ERROR_CHARS], warnings=why,
                **details)
            return None
    return rec(metric, work / s, unit, **details, seconds=round(s, 5))


def finish_child(rec: Recorder, started: float) -> None:
    """A child's last record, ``peer_process``: its wall seconds since `started`
    (``time.perf_counter()``), and whether MLX and torch were loaded in it."""
    rec("peer_process", time.perf_counter() - started, "s",
        mlx_loaded="mlx" in sys.modules, torch_loaded="torch" in sys.modules,
        mlx_env={k: v for k, v in os.environ.items() if k.startswith("MLX_")})


def parse_shapes(text: str) -> dict:
    """The ``--shapes`` JSON a child is given (`shapes_of`)."""
    return json.loads(text)


# ---- the parent's side ---------------------------------------------------------------

class Child(NamedTuple):
    """One peer process: its label (every record's ``process``), the module run with
    ``python -m``, its arguments, and variables set in its environment."""
    label: str
    module: str
    args: list[str]
    env: Mapping[str, str] = {}


def mlx_lm_impl(family: str) -> str:
    """The impl of mlx-lm's records for `family` (a key of `MLX_LM_MODULES`)."""
    return f"mlx-lm {MLX_LM_MODULES[family]}"


def shapes_of(args, label: str, **extra) -> dict:
    """A `model.archs.gemma3.ModelArgs` or `model.archs.llama.ModelArgs` as a child takes
    it: its fields, ``family`` (``gemma3``, or the Llama args' ``architecture``),
    ``sliding`` (whether each layer has a window, from its ``layer_specs()``, so no child
    imports `model`, which imports MLX), ``label`` (the records' ``model``) and `extra`
    (e.g. HF's ``rope_scaling``)."""
    sliding = [spec.window is not None for spec in args.layer_specs()]
    return {**dataclasses.asdict(args), "family": getattr(args, "architecture", "gemma3"),
            "label": label, "sliding": sliding, **extra}


def rope_scaling(shapes: dict) -> dict | None:
    """HF's ``rope_scaling`` for `shapes` (`shapes_of`), as both peers' models take it: the
    one they give (e.g. Llama 3's, whose GGUF keeps only the ``rope_freqs`` divisors), else
    linear scaling by 1 / ``rope_scale`` where prefillq scales positions, else None."""
    if shapes.get("rope_scaling") is not None:
        return shapes["rope_scaling"]
    scale = shapes.get("rope_scale", 1.0)
    return None if scale == 1.0 else {"rope_type": "linear", "factor": 1.0 / scale}


def plan(shapes: dict, cases: Iterable[tuple[int, int]], repeats: int,
         hf_repeats: int = HF_REPEATS, eager: bool = True,
         backends: Iterable[str] = (DEFAULT_BACKEND, *SDPA_BACKENDS)) -> list[Child]:
    """The children for prefillq's `cases` (``(n_tokens, chunk_tokens)``, at `shapes`):
    mlx-lm at each case; HF once per prompt length, sdpa under each of `backends`,
    flex_attention, and eager unless not `eager`."""
    cases = list(cases)
    shape_arg = ["--shapes", json.dumps(shapes)]
    lengths = [str(n) for n in sorted({n for n, _ in cases})]
    hf = ["hf", *shape_arg, "--repeats", str(hf_repeats)]
    children = [Child(process_label(mlx_lm_impl(shapes.get("family", "gemma3"))),
                      "bench.gpu_peer_mlx_lm",
                      [*shape_arg, "--repeats", str(repeats),
                       *[f"{n}:{chunk}" for n, chunk in cases]], MLX_GRAPH_DEFAULTS)]
    for backend in backends:
        children.append(Child(process_label(HF_SDPA, backend), "bench.gpu_peer_torch",
                              [*hf, "--attn", "sdpa", "--backend", backend, *lengths]))
    children.append(Child(process_label(HF_FLEX), "bench.gpu_peer_torch",
                          [*hf, "--attn", "flex_attention", *lengths]))
    if eager:
        children.append(Child(process_label(HF_EAGER), "bench.gpu_peer_torch",
                              [*hf, "--attn", "eager", *lengths]))
    return children


def attention_plan(shape: Mapping) -> list[Child]:
    """The children for torch SDPA alone at `shape` (``queries``, ``heads``,
    ``kv_heads``, ``head_dim``, ``repeats``, ``batch``: `bench.gpu_attention.MICRO`), one
    a backend."""
    args = ["--heads", str(shape["heads"]), "--kv-heads", str(shape["kv_heads"]),
            "--head-dim", str(shape["head_dim"]), "--repeats", str(shape["repeats"]),
            "--batch", str(shape["batch"]),
            *[str(q) for q in shape["queries"]]]
    return [Child(process_label(TORCH_SDPA, backend), "bench.gpu_peer_torch",
                  ["attention", "--backend", backend, *args])
            for backend in (DEFAULT_BACKEND, *SDPA_BACKENDS)]


def run_child(rec: Recorder, child: Child, timeout_s: float = CHILD_TIMEOUT_S) -> list[dict]:
    """Run `child` in a fresh process (from the repository root, its stderr passed on)
    and record its records here; returns them. A child that exits non-zero, overruns
    `timeout_s` (killed; what it printed is kept) or leaves no ``peer_process`` record
    adds a ``peer_error`` record with the end of its stderr."""
    argv = [sys.executable, "-m", child.module, *child.args]
    log(f"peer process: {child.label}")
    proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **child.env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        failure = f"exit status {proc.returncode}" if proc.returncode else None
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        failure = f"timed out after {timeout_s} s"
    sys.stderr.write(err)
    records = []
    for line in out.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a library's own print
        if isinstance(record, dict) and "metric" in record:
            records.append(rec(record.pop("metric"), record.pop("value"),
                               record.pop("unit"), **record))
    if failure is None and not any(r["metric"] == "peer_process" for r in records):
        failure = "no peer_process record"
    if failure:
        records.append(rec("peer_error", 0.0, "none", process=child.label, child_pid=proc.pid,
                           error=f"{failure}: {err[-ERROR_CHARS:]}"))
    return records


def best(records: Iterable[dict], metric: str, impl: str, size: str) -> dict[int, dict]:
    """The fastest of `records` of `metric` and `impl` for each value of their `size`
    field, over every backend measured (failures are ``peer_error`` records), torch's own
    pick (``default``) among them."""
    out: dict[int, dict] = {}
    for r in records:
        if r["metric"] == metric and r.get("impl") == impl:
            if r[size] not in out or r["value"] > out[r[size]]["value"]:
                out[r[size]] = r
    return out


# what a best record keeps of the winner's details: the shape and the versions
SHAPE_FIELDS = ("model", "dtype", "n_tokens", "chunk_tokens", "queries", "heads", "kv_heads",
                "head_dim", "layout", "picked", "torch", "transformers")


def _candidate(r: dict) -> str:
    return r["backend"] if "layout" not in r else f"{r['backend']}, {r['layout']}"


def record_best(rec: Recorder, records: list[dict]) -> list[dict]:
    """One ``"<impl> best"`` record for each model and size of torch SDPA alone and of HF
    sdpa: the fastest backend's figure, its ``backend`` (and ``layout``; for ``default``,
    the ``picked`` backend where torch said), the ``from_pid`` that measured it, and every
    backend's figure as ``candidates``."""
    added = []
    for metric, impl, size in (("attention_tflops", TORCH_SDPA, "queries"),
                               ("gpu_prefill_tok_s", HF_SDPA, "n_tokens")):
        of_impl = [r for r in records if r["metric"] == metric and r.get("impl") == impl]
        for model in dict.fromkeys(r.get("model") for r in of_impl):  # in measured order
            same = [r for r in of_impl if r.get("model") == model]
            for n, top in sorted(best(same, metric, impl, size).items()):
                at = [r for r in same if r[size] == n]
                added.append(rec(
                    metric, top["value"], top["unit"], impl=impl + BEST,
                    backend=top["backend"], **{k: top[k] for k in SHAPE_FIELDS if k in top},
                    from_pid=top["pid"], candidates={_candidate(r): r["value"] for r in at}))
    return added


def run_all(rec: Recorder, children: Iterable[Child],
            timeout_s: float = CHILD_TIMEOUT_S) -> list[dict]:
    """Every child in turn (`run_child`), then `record_best` over what they measured;
    returns all those records.

    The protocol: a child prints one JSON record a line on stdout, each tagged with its
    ``pid``, ``process`` (its label) and ``backend``, and ends with a ``peer_process`` record
    (its wall seconds, whether MLX and torch were loaded in it). A peer that is not importable
    is a ``peer_skipped`` record; a measurement that fails is a ``peer_error`` record and the
    child goes on; a child that fails or overruns is a ``peer_error`` record in the parent's
    name and the run goes on. `record_best` adds the best backend of each backend-swept peer;
    `ratios` and `attention_ratios` put prefillq's figures over them, within the run.
    """
    records = [r for child in children for r in run_child(rec, child, timeout_s)]
    return records + record_best(rec, records)


def _find(records: Iterable[dict], metric: str, impl: str, **fields) -> dict | None:
    for r in records:
        if (r["metric"] == metric and r.get("impl") == impl
                and all(r.get(k) == v for k, v in fields.items())):
            return r
    return None


def ratios(tok_s: float, n: int, chunk: int, records: Iterable[dict],
           model: str | None = None, family: str = "gemma3") -> dict:
    """prefillq's `tok_s` at `n` tokens in `chunk`-token chunks over each peer measured:
    ``over_mlx_lm`` (mlx-lm's `family` module, same prompt and chunk), ``over_hf_flex`` and
    ``over_hf_sdpa`` (the best backend's, named in ``hf_sdpa_backend``; one pass of the
    same prompt), each of the records' ``model`` `model` where given. A peer not in
    `records` is left out."""
    records = list(records)
    same = {} if model is None else {"model": model}
    out: dict = {}
    for name, impl, fields in (("over_mlx_lm", mlx_lm_impl(family), {"chunk_tokens": chunk}),
                               ("over_hf_flex", HF_FLEX, {}), ("over_hf_sdpa", HF_SDPA + BEST, {})):
        peer = _find(records, "gpu_prefill_tok_s", impl, n_tokens=n, **fields, **same)
        if peer is not None:
            out[name] = round(tok_s / peer["value"], 4)
            if impl == HF_SDPA + BEST:
                out["hf_sdpa_backend"] = peer["backend"]
    return out


def attention_ratios(tflops: float, queries: int, records: Iterable[dict]) -> dict:
    """`tflops` of attention over `queries` over torch SDPA's best backend at the same
    shape: ``over_torch_sdpa`` and ``torch_sdpa_backend``; empty if not measured."""
    peer = _find(records, "attention_tflops", TORCH_SDPA + BEST, queries=queries)
    if peer is None:
        return {}
    return {"over_torch_sdpa": round(tflops / peer["value"], 4),
            "torch_sdpa_backend": _candidate(peer)}
