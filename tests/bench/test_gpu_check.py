"""`python -m bench.gpu --check`: its list of checks, how a run of them is judged, the
logits comparison, and the one-line refusal without a CUDA GPU (the checks themselves run
on the device)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from bench import gpu_check, gpu_deepseek4
from bench.common import Recorder
from model.archs import gemma3
from model.archs._gemma3_graph import GraphForward
from tests.model.graph_harness import mlx_attend, mlx_attend_packed

ROOT = Path(__file__).resolve().parents[2]


def test_checks_are_functions_of_a_recorder():
    assert gpu_check.CHECKS == [gpu_check.fused_kernel_4_warps, gpu_check.fused_kernel_8_warps,
                                gpu_check.fused_kernel_sm90, gpu_check.gelu_gate_kernel,
                                gpu_check.qk_norm_rope_kernel,
                                gpu_check.chunked_equals_one_pass,
                                gpu_check.packed_steps_equal_each_alone,
                                gpu_check.gemma3_4b_chunked_equals_one_pass,
                                gpu_check.llama3_8b_chunked_equals_one_pass,
                                gpu_check.qwen3_4b_chunked_equals_one_pass,
                                gpu_deepseek4.check_sparse_kernel,
                                gpu_deepseek4.check_gathered_layers,
                                gpu_deepseek4.check_padded_experts]
    for check in gpu_check.CHECKS:
        params = list(inspect.signature(check).parameters.values())
        assert params[0].name == "rec"
        assert all(p.default is not p.empty for p in params[1:]), check.__name__


def test_every_check_runs_and_one_failure_fails_the_run(capsys):
    ran = []

    def passes(rec: Recorder) -> bool:
        ran.append("passes")
        return True

    def fails(rec: Recorder) -> bool:
        ran.append("fails")
        return False

    rec = Recorder(True, {})
    assert gpu_check.run_checks(rec, [fails, passes]) is False
    assert ran == ["fails", "passes"]
    assert gpu_check.run_checks(rec, [passes, passes]) is True
    assert gpu_check.run_checks(rec, []) is True
    assert "fails: FAILED" in capsys.readouterr().err


def test_the_hopper_check_is_skipped_off_hopper(capsys):
    rec = Recorder(True, {})
    assert gpu_check.fused_kernel_sm90(rec) is True
    assert "flash_attention_sm90_check_skipped" in capsys.readouterr().out


def test_compare_logits_measures_against_the_largest_logit():
    whole = np.array([1.0, -4.0, 3.0, 2.5], dtype=np.float32)
    same = gpu_check.compare_logits(whole.copy(), whole)
    assert same["diff"] == 0 and same["top1_agrees"] and same["finite"]
    assert same["top2_margin"] == 0.125  # (3 - 2.5) / 4
    nudged = whole + np.array([0, 0.2, 0, 0], dtype=np.float32)
    assert gpu_check.compare_logits(nudged, whole)["diff"] == pytest.approx(0.2 / 4)
    flipped = gpu_check.compare_logits(whole + np.array([0, 0, 0, 0.6], np.float32), whole)
    assert not flipped["top1_agrees"] and flipped["top1_chunked"] == 3
    assert not gpu_check.compare_logits(whole * np.nan, whole)["finite"]


def _tiny_bf16_gemma() -> gemma3.Model:
    """A 6-layer, 64-wide Gemma 3 in bf16 (random weights, seed 2), a 16-token window."""
    args = gemma3.ModelArgs(
        hidden_size=64, num_hidden_layers=6, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, vocab_size=512, rms_norm_eps=1e-6,
        sliding_window=16, rope_theta=1_000_000.0, context_length=256)
    mx.random.seed(2)
    model = gemma3.Model(args)
    model.set_dtype(mx.bfloat16)
    return model


def test_chunked_check_passes_on_a_tiny_bf16_model(capsys):
    model = _tiny_bf16_gemma()
    assert gpu_check.chunked_equals_one_pass(Recorder(True, {}), model, n=96, chunk=32)
    record = json.loads(capsys.readouterr().out)
    assert record["metric"] == "chunked_over_one_pass_check" and record["passed"]
    assert record["chunks"] == 3 and record["one_pass_chunks"] == 1
    assert record["value"] <= gpu_check.CHUNKED_TOLERANCE and record["top1_agrees"]


def test_packed_check_passes_on_a_tiny_bf16_model_through_mlx_attention(capsys, monkeypatch):
    """The packed-steps check on the CPU: a tiny bf16 Gemma through its compiled graphs with
    MLX's attention in place of the kernels (`tests.model.graph_harness`); later chunks
    share a launch and every job's logits are its own alone."""
    model = _tiny_bf16_gemma()
    model._graph = GraphForward(mlx_attend, mlx_attend_packed, shared_kv_bytes=0)
    monkeypatch.setattr(gemma3, "graph_applies", lambda model, cache: True)
    assert gpu_check.packed_steps_equal_each_alone(Recorder(True, {}), model,
                                                   lengths=(70, 33, 5, 40), chunk=16)
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["n_tokens"] for r in records] == [70, 33, 5, 40]
    assert all(r["passed"] and r["top1_agrees"] for r in records)
    assert records[0]["later_chunks_shared"] > 0
    assert model._graph.shared_kv_bytes == 0 and model._graph.attend_packed is mlx_attend_packed


def test_check_without_a_cuda_gpu_is_a_one_line_error():
    done = subprocess.run([sys.executable, "-m", "bench.gpu", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # no usage block, no traceback
    assert lines[0].startswith("python -m bench.gpu: error: --check needs the fused CUDA "
                               "kernels: MLX's default device is Device(cpu"), lines[0]
    assert "mlx[cuda13]" in lines[0]


def test_a_run_without_a_gpu_refuses_before_starting_any_peer():
    done = subprocess.run([sys.executable, "-m", "bench.gpu", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert "error: no GPU: MLX's default device is Device(cpu" in done.stderr
    assert "peer process" not in done.stderr  # `gpu_peers.run_child`'s log line
