"""`bench.gpu`'s dense models (`MODELS`): their FLOPs against the published parameter
counts, prefillq's model built at their shapes, mlx-lm's peer computing prefillq's function
at them, the peers' processes and ratios per model, and `--models` parsing. All on the
CPU, at the real shapes where only arithmetic is involved and tiny ones where weights are."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from bench import gpu, gpu_check, gpu_peers
from bench.common import Recorder
from bench.gpu import LLAMA3_8B, MODELS, QWEN3_4B, GpuModel, decoder_flops
from bench.prefill import their_name

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = replace(LLAMA3_8B, hidden_size=64, num_hidden_layers=3, intermediate_size=128,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     vocab_size=300, context_length=512, sliding_layers=(False,) * 3)
TINY_QWEN3 = replace(QWEN3_4B, hidden_size=64, num_hidden_layers=3, intermediate_size=128,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     vocab_size=300, context_length=512, sliding_layers=(False,) * 3)
TINY_SPECS = {
    # a short original context, so a 200-token prompt reaches the scaled frequencies
    "llama": GpuModel("t-llama", "tiny llama", TINY_LLAMA, ((200, 64),),
                      replace(gpu.LLAMA3_SCALING, original_context=64)),
    "qwen3": GpuModel("t-qwen3", "tiny qwen3", TINY_QWEN3, ((200, 64),)),
}


@pytest.mark.parametrize(("spec", "params", "rel"), [
    # Meta-Llama-3-8B: 8.03B parameters, of which the input embedding is 128,256 x 4,096
    # (the head, the same size, is counted: it runs once per prefill, not per token)
    ("llama3-8b", 8.030e9 - 128_256 * 4096, 1e-3),
    # Qwen3-4B's model card: 3.6B non-embedding parameters (rounded), the head tied
    ("qwen3-4b", 3.6e9, 2e-2),
])
def test_flops_per_token_are_twice_the_published_parameters(spec, params, rel):
    args = MODELS[spec].args
    one = decoder_flops(args, 1)
    head = 2 * args.hidden_size * args.vocab_size
    attention = 4 * args.num_attention_heads * args.head_dim * args.num_hidden_layers
    per_token = one - head - attention
    if spec == "llama3-8b":
        per_token += head  # the head's parameters are part of the 8.03B
    assert per_token / 2 == pytest.approx(params, rel=rel)
    # causal attention: a query at position p sees p + 1 keys
    n = 1000
    assert decoder_flops(args, n) - n * (one - head - attention) - head == \
        attention * n * (n + 1) // 2


@pytest.mark.parametrize("family", sorted(TINY_SPECS))
def test_the_chunked_check_passes_on_a_tiny_bf16_model_of_each_family(family, capsys):
    mx.random.seed(3)
    model = TINY_SPECS[family].build(mx.bfloat16)
    assert model.args.architecture == family
    assert gpu_check.chunked_equals_one_pass(Recorder(True, {}), model, n=200, chunk=64)
    record = json.loads(capsys.readouterr().out)
    assert record["passed"] and record["chunks"] == 4


@pytest.mark.parametrize("family", sorted(TINY_SPECS))
def test_mlx_lm_at_the_shapes_computes_prefillqs_function(family):
    pytest.importorskip("mlx_lm")
    from bench import gpu_peer_mlx_lm
    from model.start import start_prefill

    spec = TINY_SPECS[family]
    mx.random.seed(4)
    ours = spec.build(mx.float32)
    shapes = spec.shapes()
    assert shapes["family"] == family and shapes["label"] == spec.label
    assert (shapes["rope_scaling"] is None) == (spec.scaling is None)
    peer = gpu_peer_mlx_lm.mlx_lm_model(shapes, dtype=mx.float32)
    peer.load_weights([(their_name(family, k), v) for k, v in tree_flatten(ours.parameters())],
                      strict=True)
    ids = [(13 * i + 5) % spec.args.vocab_size for i in range(200)]
    want = start_prefill(ours, ids, vocab_size=spec.args.vocab_size,
                         context_length=spec.args.context_length, chunk_tokens=64).run()
    got = np.array(gpu_peer_mlx_lm.mlx_lm_prefill(peer, mx.array(ids), 64)[0])
    assert float(np.abs(got - want).max() / np.abs(want).max()) < 1e-5


def test_each_model_gets_its_own_peers_and_ratios_come_from_its_own_records():
    llama, qwen = MODELS["llama3-8b"], MODELS["qwen3-4b"]
    children = [c for s in (llama, qwen) for c in gpu_peers.plan(
        s.shapes(), s.cases, repeats=5, eager=False, backends=["cudnn"])]
    assert [c.label for c in children] == [
        "mlx-lm llama", "transformers sdpa, backend cudnn", "transformers flex_attention",
        "mlx-lm qwen3", "transformers sdpa, backend cudnn", "transformers flex_attention"]
    assert json.loads(children[0].args[1])["rope_scaling"]["rope_type"] == "llama3"
    assert children[0].args[-2:] == ["8192:2048", "32768:2048"]

    def tok_s(impl, value, model, backend=None):
        return {"metric": "gpu_prefill_tok_s", "value": value, "unit": "tok/s", "impl": impl,
                "backend": backend, "model": model, "n_tokens": 8192, "chunk_tokens": 2048,
                "pid": 7}
    records = [tok_s("mlx-lm llama", 10.0, llama.label), tok_s("mlx-lm qwen3", 40.0, qwen.label),
               tok_s(gpu_peers.HF_SDPA, 20.0, llama.label, "cudnn"),
               tok_s(gpu_peers.HF_SDPA, 50.0, qwen.label, "cudnn")]
    records += gpu_peers.record_best(Recorder(False, {}), records)
    assert gpu_peers.ratios(80.0, 8192, 2048, records, model=llama.label, family="llama") == {
        "over_mlx_lm": 8.0, "over_hf_sdpa": 4.0, "hf_sdpa_backend": "cudnn"}
    assert gpu_peers.ratios(80.0, 8192, 2048, records, model=qwen.label, family="qwen3") == {
        "over_mlx_lm": 2.0, "over_hf_sdpa": 1.6, "hf_sdpa_backend": "cudnn"}


def test_an_unknown_model_is_a_one_line_error():
    done = subprocess.run([sys.executable, "-m", "bench.gpu", "--models", "llama3-8b,gpt5"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "argument --models: gpt5 is not among gemma3-270m, gemma3-4b, llama3-8b, qwen3-4b" in \
        done.stderr
