"""`bench.gpu_peer_torch`, where torch and transformers are installed (they are not test
dependencies): HF's Gemma 3 at prefillq's shapes computes prefillq's function under each
attention implementation, and the children measure for real on the CPU."""

from __future__ import annotations

import json
import os

import pytest

from bench import gpu_peer_torch, gpu_peers
from bench.common import Recorder
from bench.gpu_peers import HF_SDPA, TORCH_SDPA, Child, shapes_of
from tests.bench.tiny_gemma import (
    TINY,
    TINY_SCALED,
    TINY_SHAPES,
    N,
    assert_computes_prefillq,
    prefillq_tiny,
    their_weights,
)


def test_scores_fit_only_within_the_share_of_free_memory():
    need = 4 * 32_768 * 32_768 * gpu_peer_torch.SCORE_BYTES  # 48 GiB
    assert gpu_peer_torch.scores_fit(4, 32_768, free_bytes=139 * 2**30)
    assert not gpu_peer_torch.scores_fit(4, 32_768, free_bytes=int(need / 0.8) - 1)
    assert gpu_peer_torch.scores_fit(4, 32_768, free_bytes=int(need / 0.8) + 1)


@pytest.mark.parametrize("args", [TINY, TINY_SCALED], ids=["tiny", "scaled"])
@pytest.mark.parametrize("attn", ["sdpa", "flex_attention", "eager"])
def test_hf_prefills_the_same_function_as_prefillq(attn, args):
    """HF's Gemma 3 with prefillq's weights gives prefillq's logits, also with the global
    layer's RoPE linearly scaled and 27B's kind of query scale (HF applies its
    ``full_attention`` RoPE parameters to the global layers only, as llama.cpp does)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    ours = prefillq_tiny(args)
    peer = gpu_peer_torch.hf_model(attn, shapes_of(args, "gemma3 tiny"), device="cpu",
                                   dtype=torch.float32)
    assert type(peer).__name__ == "Gemma3ForCausalLM"
    assert peer.config._attn_implementation == attn
    missing, unexpected = peer.load_state_dict(
        {k: torch.from_numpy(v) for k, v in their_weights(ours).items()}, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    assert peer.lm_head.weight.data_ptr() == peer.model.embed_tokens.weight.data_ptr()
    assert_computes_prefillq(ours, lambda ids: gpu_peer_torch.hf_prefill(
        peer, torch.tensor([ids]))[0].float().numpy())


def test_a_backend_is_enforced_and_its_refusal_recorded():
    pytest.importorskip("torch")
    rec = gpu_peers.child_recorder("test", "cudnn")
    gpu_peer_torch.attention_cases(rec, "cudnn", [64], 4, 1, 32, 1, device="cpu")
    assert [r["metric"] for r in rec.records] == ["peer_error"] * 2  # no cuDNN on a CPU
    rec = gpu_peers.child_recorder("test", "math")
    gpu_peer_torch.attention_cases(rec, "math", [64], 4, 1, 32, 1, device="cpu")
    assert [r["layout"] for r in rec.records] == ["enable_gqa", "expanded kv"]
    assert all(r["metric"] == "attention_tflops" and r["seconds"] > 0 for r in rec.records)


def test_the_torch_children_measure_in_their_own_processes_and_the_best_is_kept():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    attention = ["--heads", "4", "--kv-heads", "1", "--head-dim", "32", "--repeats", "1",
                 "--device", "cpu", "64"]
    hf = ["hf", "--shapes", json.dumps(TINY_SHAPES), "--repeats", "1",
          "--device", "cpu", "--attn", "sdpa"]
    children = [*[Child(gpu_peers.process_label(TORCH_SDPA, b), "bench.gpu_peer_torch",
                        ["attention", "--backend", b, *attention]) for b in ("default", "math")],
                *[Child(gpu_peers.process_label(HF_SDPA, b), "bench.gpu_peer_torch",
                        [*hf, "--backend", b, str(N)]) for b in ("math", "cudnn")]]
    rec = Recorder(False, {}, tags={"pid": os.getpid(), "process": "parent"})
    records = gpu_peers.run_all(rec, children, timeout_s=300)
    measured = [r for r in records if r["metric"] in ("attention_tflops", "gpu_prefill_tok_s")
                and "best" not in r["impl"]]
    assert len(measured) == 5 and all(r["pid"] != os.getpid() for r in measured)
    assert {r["backend"] for r in measured} == {"default", "math"}
    assert measured[0]["picked"]  # torch's own pick, as torch names it
    best = [r for r in records if r.get("impl", "").endswith(" best")]
    assert [r["impl"] for r in best] == [TORCH_SDPA + " best", HF_SDPA + " best"]
    assert best[1]["backend"] == "math" and set(best[1]["candidates"]) == {"math"}
    assert [r["backend"] for r in records if r["metric"] == "peer_error"] == ["cudnn"]
