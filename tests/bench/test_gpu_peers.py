"""`bench.gpu_peers`: which processes `python -m bench.gpu` starts for its peers, the
protocol they answer in, the best backend it keeps and the ratios it writes.

The processes here are real children (``python -m``), on the CPU: without torch or
mlx-lm installed each answers with a ``peer_skipped`` record and its ``peer_process``
record, which is what the protocol is made of; where torch is installed the torch child
also measures (`test_gpu_peer_torch.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from bench import gpu_peers
from bench.common import Recorder
from bench.gpu_attention import MICRO
from bench.gpu_peers import HF_EAGER, HF_FLEX, HF_SDPA, MLX_LM, SDPA_BACKENDS, TORCH_SDPA, Child
from tests.bench.tiny_gemma import TINY, TINY_SHAPES

BACKENDS = ["default", *SDPA_BACKENDS]


def test_plan_gives_every_peer_and_backend_a_process_of_its_own():
    children = gpu_peers.plan(TINY_SHAPES, [(64, 32), (64, 64), (128, 32)], repeats=2)
    labels = [c.label for c in children]
    assert labels == [MLX_LM, *[f"{HF_SDPA}, backend {b}" for b in BACKENDS], HF_FLEX,
                      HF_EAGER]
    mlx_lm, *torch = children
    assert mlx_lm.module == "bench.gpu_peer_mlx_lm" and mlx_lm.env == \
        gpu_peers.MLX_GRAPH_DEFAULTS
    assert mlx_lm.args[-3:] == ["64:32", "64:64", "128:32"]
    for child, backend in zip(torch[:5], BACKENDS, strict=True):
        assert child.module == "bench.gpu_peer_torch" and not child.env
        assert child.args[child.args.index("--backend") + 1] == backend
        assert child.args[-2:] == ["64", "128"]  # HF: one pass per prompt length
    assert [c.label for c in gpu_peers.plan(TINY_SHAPES, [(64, 32)], 2, eager=False)][-1] \
        == HF_FLEX
    attention = gpu_peers.attention_plan(MICRO)
    assert [c.label for c in attention] == [f"{TORCH_SDPA}, backend {b}" for b in BACKENDS]
    assert attention[0].args[-2:] == ["8192", "32768"]


def test_shapes_carry_each_layer_kind_so_no_child_imports_model():
    assert TINY_SHAPES["sliding"] == [TINY.is_sliding(i) for i in range(6)]
    assert TINY_SHAPES["sliding"] == [True] * 5 + [False]
    assert TINY_SHAPES["head_dim"] == 32 and TINY_SHAPES["label"] == "gemma3 tiny"


def _attention_child(backend: str) -> Child:
    return Child(gpu_peers.process_label(TORCH_SDPA, backend), "bench.gpu_peer_torch",
                 ["attention", "--backend", backend, "--heads", "4", "--kv-heads", "1",
                  "--head-dim", "32", "--repeats", "1", "--device", "cpu", "64"])


def test_each_peer_runs_in_a_process_of_its_own_and_says_which():
    children = [_attention_child("default"), _attention_child("math"),
                *gpu_peers.plan(TINY_SHAPES, [(64, 32)], repeats=1)[:1]]  # and mlx-lm's
    rec = Recorder(False, {}, tags={"pid": os.getpid(), "process": "parent"})
    records = gpu_peers.run_all(rec, children, timeout_s=300)
    by_process = {}
    for r in records:
        if r["process"] != "parent":
            by_process.setdefault(r["process"], []).append(r)
    assert list(by_process) == [c.label for c in children]
    pids = set()
    for child in children:
        got = by_process[child.label]
        assert {r["pid"] for r in got} != {os.getpid()} and len({r["pid"] for r in got}) == 1
        pids |= {got[0]["pid"]}
        assert got[-1]["metric"] == "peer_process", got
        assert all("backend" in r for r in got)
    assert len(pids) == len(children)  # no two peers shared a process
    torch_ends = [by_process[c.label][-1] for c in children[:2]]
    assert [r["backend"] for r in torch_ends] == ["default", "math"]
    assert not any(r["mlx_loaded"] for r in torch_ends)  # torch never shares with MLX
    mlx_lm_end = by_process[MLX_LM][-1]
    assert gpu_peers.MLX_GRAPH_DEFAULTS.items() <= mlx_lm_end["mlx_env"].items()  # not ours
    assert not [r for r in records if r["metric"] == "peer_error"]


def test_a_child_that_fails_overruns_or_says_nothing_is_a_peer_error_and_the_run_goes_on():
    children = [Child("bad shapes", "bench.gpu_peer_mlx_lm", ["--shapes", "{", "64:32"]),
                Child("sleeper", "timeit", ["-n", "1", "import time; time.sleep(60)"]),
                Child("silent", "this", [])]  # prints prose, no record
    rec = Recorder(False, {}, tags={"pid": os.getpid(), "process": "parent"})
    records = gpu_peers.run_all(rec, children, timeout_s=5)
    assert [r["metric"] for r in records] == ["peer_error"] * 3
    assert [r["process"] for r in records] == ["bad shapes", "sleeper", "silent"]
    assert all(r["pid"] == os.getpid() and r["child_pid"] != os.getpid() for r in records)
    bad, sleeper, silent = (r["error"] for r in records)
    assert bad.startswith("exit status 2: ") and "--shapes" in bad
    assert sleeper.startswith("timed out after 5 s")
    assert silent.startswith("no peer_process record")


def test_measure_records_the_rate_or_the_error_with_the_warnings_that_explain_it(capsys):
    rec = gpu_peers.child_recorder("a peer", "flash")
    got = gpu_peers.measure(rec, "gpu_prefill_tok_s", "tok/s", 8192, lambda: 0.5, n_tokens=8)
    assert got["value"] == 16384.0 and got["seconds"] == 0.5
    assert got["pid"] == os.getpid() and got["process"] == "a peer" and got["backend"] == "flash"

    def refuses() -> float:
        warnings.warn("Flash attention does not support non-null attn_mask.", stacklevel=1)
        raise RuntimeError("No available kernel. Aborting execution." + "!" * 1000)

    assert gpu_peers.measure(rec, "gpu_prefill_tok_s", "tok/s", 8192, refuses) is None
    error = rec.records[-1]
    assert error["metric"] == "peer_error" and error["for_metric"] == "gpu_prefill_tok_s"
    assert error["error"].startswith("RuntimeError: No available kernel")
    assert len(error["error"]) == gpu_peers.ERROR_CHARS
    assert error["warnings"] == ["Flash attention does not support non-null attn_mask."]


def _tflops(backend: str, value: float, queries: int = 8192, layout: str = "enable_gqa",
            pid: int = 11) -> dict:
    return {"metric": "attention_tflops", "value": value, "unit": "TFLOP/s",
            "impl": TORCH_SDPA, "backend": backend, "layout": layout, "queries": queries,
            "heads": 4, "pid": pid}


def _tok_s(impl: str, value: float, n: int, chunk: int, backend: str | None = None) -> dict:
    return {"metric": "gpu_prefill_tok_s", "value": value, "unit": "tok/s", "impl": impl,
            "backend": backend, "n_tokens": n, "chunk_tokens": chunk, "pid": 12}


def test_the_best_backend_is_the_fastest_measured_at_each_size():
    records = [
        _tflops("default", 640.0, pid=1, layout="expanded kv"), _tflops("cudnn", 660.0, pid=2),
        _tflops("flash", 290.0, pid=3), _tflops("flash", 300.0, pid=3, layout="expanded kv"),
        {"metric": "peer_error", "value": 0.0, "impl": TORCH_SDPA, "backend": "efficient",
         "queries": 8192, "pid": 4},
        _tflops("math", 20.0, queries=32_768, pid=5), _tflops("flash", 295.0, queries=32_768),
        _tok_s(HF_SDPA, 2e5, 8192, 8192, "cudnn"), _tok_s(HF_SDPA, 2.2e5, 8192, 8192, "default"),
        _tok_s(HF_FLEX, 9e5, 8192, 8192, "flex_attention")]
    best = gpu_peers.best(records, "attention_tflops", TORCH_SDPA, "queries")
    assert {n: (r["backend"], r["value"]) for n, r in best.items()} == {
        8192: ("cudnn", 660.0), 32_768: ("flash", 295.0)}

    rec = Recorder(False, {}, tags={"pid": 99, "process": "parent"})
    added = gpu_peers.record_best(rec, records)
    assert [(r["impl"], r.get("queries", r.get("n_tokens")), r["backend"]) for r in added] == [
        (TORCH_SDPA + " best", 8192, "cudnn"), (TORCH_SDPA + " best", 32_768, "flash"),
        (HF_SDPA + " best", 8192, "default")]
    top = added[0]
    assert top["value"] == 660.0 and top["layout"] == "enable_gqa" and top["heads"] == 4
    assert top["from_pid"] == 2 and top["pid"] == 99  # measured there, chosen here
    assert top["candidates"] == {"default, expanded kv": 640.0, "cudnn, enable_gqa": 660.0,
                                 "flash, enable_gqa": 290.0, "flash, expanded kv": 300.0}
    assert added[2]["candidates"] == {"cudnn": 2e5, "default": 2.2e5}
    assert added[2]["chunk_tokens"] == 8192


def test_ratios_put_prefillq_over_each_peer_measured_in_the_run():
    records = [_tok_s(MLX_LM, 100.0, 8192, 2048), _tok_s(MLX_LM, 400.0, 8192, 8192),
               _tok_s(HF_FLEX, 250.0, 8192, 8192), _tok_s(HF_SDPA, 1.0, 8192, 8192, "math"),
               _tok_s(HF_SDPA + " best", 500.0, 8192, 8192, "cudnn"),
               _tok_s(HF_FLEX, 7.0, 32_768, 32_768)]
    assert gpu_peers.ratios(200.0, 8192, 2048, records) == {
        "over_mlx_lm": 2.0, "over_hf_flex": 0.8, "over_hf_sdpa": 0.4, "hf_sdpa_backend": "cudnn"}
    assert gpu_peers.ratios(200.0, 8192, 8192, records)["over_mlx_lm"] == 0.5
    assert gpu_peers.ratios(14.0, 32_768, 2048, records) == {"over_hf_flex": 2.0}
    assert gpu_peers.ratios(150.0, 8192, 2048, []) == {}

    best = {**_tflops("cudnn", 640.0), "impl": TORCH_SDPA + " best"}
    assert gpu_peers.attention_ratios(160.0, 8192, [_tflops("cudnn", 1.0), best]) == {
        "over_torch_sdpa": 0.25, "torch_sdpa_backend": "cudnn, enable_gqa"}
    assert gpu_peers.attention_ratios(160.0, 32_768, [best]) == {}


@pytest.mark.parametrize("module", ["bench.gpu_peers", "bench.gpu_peer_torch"])
def test_the_torch_side_imports_no_mlx(module):
    done = subprocess.run([sys.executable, "-c", f"import sys, {module}; "
                           "print('mlx' in sys.modules, 'model' in sys.modules)"],
                          capture_output=True, text=True, timeout=120, cwd=gpu_peers.ROOT)
    assert done.stdout.split() == ["False", "False"], done.stderr
