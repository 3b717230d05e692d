"""The peers `python -m bench.gpu` measures beside prefillq (`bench.gpu_peers`).

The record and ratio logic runs everywhere. The peers themselves run at tiny shapes on the
CPU only where mlx-lm, torch and transformers are installed (they are not test
dependencies): there each computes the same function as prefillq's Gemma 3 given
prefillq's weights, so the GPU run compares like with like.
"""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from bench import gpu_peers
from bench.common import Recorder
from model.archs import gemma3
from model.prefill import start_prefill

# One global layer in six, a 16-token window that 80-token prompts in 32-token chunks cross,
# and a hidden size whose square root bf16 holds exactly (mlx-lm rounds it to bf16).
TINY = gemma3.ModelArgs(
    hidden_size=64, num_hidden_layers=6, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=1, head_dim=32, vocab_size=512, rms_norm_eps=1e-6, sliding_window=16,
    rope_theta=1_000_000.0, context_length=256)
N, CHUNK = 80, 32
# float32 on the CPU, the same equations in another order: max |diff| / max |logit|
# measures ~1e-6; a wrong scale, RoPE base, window or norm moves it by 1e-2 or more.
SAME_FUNCTION_RTOL = 1e-4

NAMES = {  # prefillq's module names -> HF's (and mlx-lm's, which follows HF)
    "attn.attn_q": "self_attn.q_proj", "attn.attn_k": "self_attn.k_proj",
    "attn.attn_v": "self_attn.v_proj", "attn.attn_output": "self_attn.o_proj",
    "attn.attn_q_norm": "self_attn.q_norm", "attn.attn_k_norm": "self_attn.k_norm",
    "mlp.ffn_gate": "mlp.gate_proj", "mlp.ffn_up": "mlp.up_proj",
    "mlp.ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm"}


def test_ratios_divide_prefillq_by_each_peer_at_its_case():
    peers = {(gpu_peers.MLX_LM, 8192, 2048): 100.0, (gpu_peers.MLX_LM, 8192, 8192): 400.0,
             (gpu_peers.HF_FLEX, 8192, 8192): 250.0, ("transformers sdpa", 8192, 8192): 1.0,
             (gpu_peers.HF_FLEX, 32_768, 32_768): 7.0}
    assert gpu_peers.ratios(200.0, 8192, 2048, peers) == {"over_mlx_lm": 2.0,
                                                          "over_hf_flex": 0.8}
    assert gpu_peers.ratios(200.0, 8192, 8192, peers) == {"over_mlx_lm": 0.5,
                                                          "over_hf_flex": 0.8}


def test_ratios_leave_out_the_peers_not_measured():
    peers = {(gpu_peers.HF_FLEX, 32_768, 32_768): 300.0}
    assert gpu_peers.ratios(150.0, 32_768, 2048, peers) == {"over_hf_flex": 0.5}
    assert gpu_peers.ratios(150.0, 8192, 2048, peers) == {}
    assert gpu_peers.ratios(150.0, 8192, 2048, {}) == {}


def test_a_peer_record_says_impl_case_and_versions(capsys):
    rec = Recorder(True, {})
    got = gpu_peers.measure_peer(rec, gpu_peers.MLX_LM, 8192, 2048, lambda: 0.5,
                                 mlx_lm="0.32.2", mlx="0.32.4")
    assert got == {(gpu_peers.MLX_LM, 8192, 2048): 16384.0}
    record = json.loads(capsys.readouterr().out)
    assert record == {"metric": "gpu_prefill_tok_s", "value": 16384.0, "unit": "tok/s",
                      "impl": "mlx-lm gemma3_text", "model": "gemma3-270m shapes",
                      "dtype": "bfloat16", "n_tokens": 8192, "chunk_tokens": 2048,
                      "seconds": 0.5, "mlx_lm": "0.32.2", "mlx": "0.32.4"}


def test_a_failing_peer_is_recorded_and_the_run_goes_on(capsys):
    def out_of_memory() -> float:
        raise MemoryError("CUDA out of memory. Tried to allocate 64.00 GiB" + "!" * 1000)

    rec = Recorder(True, {})
    assert gpu_peers.measure_peer(rec, gpu_peers.HF_IMPLS["sdpa"], 32_768, 32_768,
                                  out_of_memory, torch="2.11") == {}
    record = json.loads(capsys.readouterr().out)
    assert record["metric"] == "gpu_prefill_error" and record["value"] == 0
    assert record["impl"] == "transformers sdpa" and record["n_tokens"] == 32_768
    assert record["error"].startswith("MemoryError: CUDA out of memory")
    assert len(record["error"]) == gpu_peers.ERROR_CHARS and record["torch"] == "2.11"


@pytest.mark.parametrize("missing", ["mlx_lm", "torch", "transformers"])
def test_a_peer_that_is_not_importable_is_skipped_with_a_log_line(monkeypatch, capsys,
                                                                   missing):
    monkeypatch.setitem(__import__("sys").modules, missing, None)  # import raises ImportError
    rec = Recorder(True, {})
    if missing == "mlx_lm":
        assert gpu_peers.mlx_lm_cases(rec, [(64, 32)], repeats=1, args=TINY) == {}
    else:
        assert gpu_peers.hf_cases(rec, [64], repeats=1, args=TINY, device="cpu") == {}
    out = capsys.readouterr()
    assert rec.records == [] and out.out == ""
    assert "not importable" in out.err and "skipped" in out.err


def _prefillq_tiny() -> gemma3.Model:
    mx.random.seed(1)
    model = gemma3.Model(TINY)
    # random norm weights (prefillq's multiply by w; HF's and mlx-lm's by 1 + w)
    norms = {k: 1 + 0.3 * mx.random.normal(v.shape) for k, v in
             tree_flatten(model.parameters()) if "norm" in k}
    model.load_weights(list(norms.items()), strict=False)
    mx.eval(model.parameters())
    return model


def _their_weights(model: gemma3.Model) -> dict[str, np.ndarray]:
    ours = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    theirs = {"model.embed_tokens.weight": ours["token_embd.weight"],
              "model.norm.weight": ours["output_norm.weight"] - 1}
    for i in range(TINY.num_hidden_layers):
        for mine, hf in NAMES.items():
            w = ours[f"blk.{i}.{mine}.weight"]
            theirs[f"model.layers.{i}.{hf}.weight"] = w - 1 if "norm" in mine else w
    assert len(theirs) == len(ours)
    return theirs


def _prefillq_logits(model: gemma3.Model, ids: list[int]) -> np.ndarray:
    return start_prefill(model, ids, vocab_size=TINY.vocab_size,
                         context_length=TINY.context_length, chunk_tokens=CHUNK).run()


def _relative_gap(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_mlx_lm_prefills_the_same_function_as_prefillq():
    pytest.importorskip("mlx_lm")
    ours = _prefillq_tiny()
    peer = gpu_peers.mlx_lm_model(TINY, dtype=mx.float32)
    peer.load_weights([(k, mx.array(v)) for k, v in _their_weights(ours).items()])
    ids = [(7 * i + 3) % TINY.vocab_size for i in range(N)]
    theirs = np.array(gpu_peers.mlx_lm_prefill(peer, mx.array(ids), CHUNK)[0])
    assert theirs.shape == (TINY.vocab_size,)
    assert _relative_gap(theirs, _prefillq_logits(ours, ids)) < SAME_FUNCTION_RTOL
    # and its own full-vocabulary forward agrees with the last-position head
    full = np.array(peer(mx.array(ids)[None])[0, -1])
    assert _relative_gap(theirs, full) < SAME_FUNCTION_RTOL


def test_mlx_lm_prefill_seconds_at_tiny_shapes():
    pytest.importorskip("mlx_lm")
    rec = Recorder(True, {})
    peers = gpu_peers.mlx_lm_cases(rec, [(N, CHUNK)], repeats=1, args=TINY)
    assert peers[(gpu_peers.MLX_LM, N, CHUNK)] > 0
    assert rec.records[0]["impl"] == gpu_peers.MLX_LM and rec.records[0]["mlx_lm"]


@pytest.mark.parametrize("attn", ["sdpa", "flex_attention"])
def test_hf_prefills_the_same_function_as_prefillq(attn):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    ours = _prefillq_tiny()
    peer = gpu_peers.hf_model(attn, TINY, device="cpu", dtype=torch.float32)
    assert type(peer).__name__ == "Gemma3ForCausalLM"
    assert peer.config._attn_implementation == attn
    missing, unexpected = peer.load_state_dict(
        {k: torch.from_numpy(v) for k, v in _their_weights(ours).items()}, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    assert peer.lm_head.weight.data_ptr() == peer.model.embed_tokens.weight.data_ptr()
    ids = [(7 * i + 3) % TINY.vocab_size for i in range(N)]
    theirs = gpu_peers.hf_prefill(peer, torch.tensor([ids]))[0].float().numpy()
    assert theirs.shape == (TINY.vocab_size,)
    assert _relative_gap(theirs, _prefillq_logits(ours, ids)) < SAME_FUNCTION_RTOL


def test_hf_cases_record_both_attentions_at_tiny_shapes():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    rec = Recorder(True, {})
    peers = gpu_peers.hf_cases(rec, [N], repeats=1, args=TINY, device="cpu")
    assert set(peers) == {(impl, N, N) for impl in gpu_peers.HF_IMPLS.values()}
    assert all(r["metric"] == "gpu_prefill_tok_s" and r["transformers"] for r in rec.records)


def test_the_peers_child_runs_under_mlx_graph_defaults_and_reports_back(monkeypatch):
    """`measure_in_child`'s plumbing: the child gets MLX's own graph knobs, its records come
    back with them, and a failed child is an error record, not a crash."""
    seen = {}

    def fake_run(argv, env, capture_output, text):  # the child, as a process would answer
        seen.update(argv=argv, env=env)
        out = json.dumps({"metric": "gpu_prefill_tok_s", "value": 1000.0, "unit": "tok/s",
                          "impl": gpu_peers.MLX_LM, "n_tokens": 64, "chunk_tokens": 32})
        return subprocess.CompletedProcess(argv, 0, "a library's line\n" + out + "\n", "")

    monkeypatch.setattr(gpu_peers.subprocess, "run", fake_run)
    rec = Recorder(False, {})
    peers = gpu_peers.measure_in_child(rec, [(64, 32)], 2)
    assert seen["argv"][1:] == ["-m", "bench.gpu_peers", "--repeats", "2", "64:32"]
    assert all(seen["env"][k] == v for k, v in gpu_peers.MLX_GRAPH_DEFAULTS.items())
    assert peers == {(gpu_peers.MLX_LM, 64, 32): 1000.0}
    assert rec.records[0]["mlx_env"] == gpu_peers.MLX_GRAPH_DEFAULTS

    monkeypatch.setattr(gpu_peers.subprocess, "run", lambda argv, **kw:
                        subprocess.CompletedProcess(argv, 1, "", "Traceback: boom"))
    rec = Recorder(False, {})
    assert gpu_peers.measure_in_child(rec, [(64, 32)], 2) == {}
    assert rec.records[-1]["metric"] == "gpu_prefill_error" and "boom" in rec.records[-1]["error"]


def test_the_peers_module_runs_as_a_child(tmp_path):
    """``python -m bench.gpu_peers`` for real: JSON lines only on stdout (none here when no
    peer is importable, or the peers' records when they are)."""
    done = subprocess.run([sys.executable, "-m", "bench.gpu_peers", "--repeats", "1", "16:16"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    for line in done.stdout.splitlines():
        assert json.loads(line)["metric"] in ("gpu_prefill_tok_s", "gpu_prefill_error")
