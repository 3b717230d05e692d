"""`bench.prefill.mlx_lm_twin`, where mlx-lm is installed (it is not a test dependency):
mlx-lm's own model of each family, on prefillq's arrays, computes prefillq's logits, so
`forward_over_mlx_lm` times the same function in both. For ``llama-tiny`` mlx-lm derives
Llama 3's RoPE frequencies from HF's config itself: an independent check of the
``rope_freqs`` divisors the tiny GGUF carries."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from bench.prefill import mlx_lm_twin
from model.gguf.synthetic.llama import LLAMA_TINY
from model.registry import load_model

# float32 on the CPU, the same equations in another order: max |diff| / max |logit|
# measured 1.4e-7 to 3.0e-7; a wrong RoPE layout, scaling, norm or bias moves it by 1e-2
# or more (llama-tiny without its Llama 3 scaling: 0.2).
SAME_FUNCTION_RTOL = 1e-5
LLAMA_TINY_SCALING = {
    "rope_type": "llama3", "factor": LLAMA_TINY.llama3.factor,
    "low_freq_factor": LLAMA_TINY.llama3.low_freq_factor,
    "high_freq_factor": LLAMA_TINY.llama3.high_freq_factor,
    "original_max_position_embeddings": LLAMA_TINY.llama3.original_context}


@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny", "qwen3-tiny", "gemma3-tiny"])
def test_the_twin_computes_prefillqs_logits(name):
    pytest.importorskip("mlx_lm")
    loaded = load_model(name)
    # past llama-tiny's 256-token original context, where the scaled frequencies bind
    ids = [(37 * i + 11) % loaded.model.args.vocab_size for i in range(600)]
    ours = loaded.start_prefill(ids, 128).run()
    twin = mlx_lm_twin(loaded, LLAMA_TINY_SCALING if name == "llama-tiny" else None)
    theirs = np.array(twin(mx.array(ids)[None])[0, -1])
    gap = float(np.abs(theirs - ours).max() / np.abs(ours).max())
    assert gap < SAME_FUNCTION_RTOL, gap
    assert int(theirs.argmax()) == int(ours.argmax())


def test_a_scaled_rope_without_its_config_is_refused():
    pytest.importorskip("mlx_lm")
    with pytest.raises(ValueError, match="llama-tiny scales its RoPE"):
        mlx_lm_twin(load_model("llama-tiny"))


def test_bench_prompts_are_each_models_own_token_ids():
    import json

    from bench.common import DATA, prompt_ids

    for model, bos in (("gemma3-270m", [2]), ("smollm2-135m", [])):
        reference = json.loads((DATA / f"{model}-llamacpp.json").read_text())
        longest = reference["cases"][-1]["tokens"]
        ids = prompt_ids(3 * len(longest), model)
        body = longest[len(bos):]
        assert ids[:len(bos)] == bos and len(ids) == 3 * len(longest)
        assert ids[len(bos):len(bos) + 2 * len(body)] == body * 2  # tiled
