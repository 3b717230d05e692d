"""What `model.archs.llama` reads from a GGUF: quantized weights of every type the ``gguf``
package writes here (Q4_1 as SmolLM2's file), and clear errors for what it does not
implement or cannot read (an unsupported tensor type names the tensor)."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from model.archs import llama
from model.gguf.reader import GGUFError, read_gguf, supported_tensor_types
from model.gguf.synthetic.llama import LLAMA_TINY, QWEN3_TINY, write_tiny_llama
from model.registry import load_model
from tests.model import llama_reference as reference
from tests.model.gguf_edits import with_metadata

# float32 MLX vs the float64 reference on the same dequantized weights: 4.9e-7 (Q4_0) to
# 7.7e-7 (F16) measured (max |diff| / max |logit|, every position of 200 tokens); ~4x that.
QUANT_BOUND = 3e-6
Q = GGMLQuantizationType


@pytest.mark.parametrize("quant", [Q.Q4_0, Q.Q4_1, Q.Q5_1, Q.Q8_0, Q.BF16, Q.F16],
                         ids=lambda q: q.name)
def test_quantized_weights_load_and_match_the_reference(tmp_path, quant):
    path = write_tiny_llama(tmp_path / "q.gguf", LLAMA_TINY, quant=quant)
    gguf = read_gguf(path)
    assert gguf.tensor_types["blk.0.attn_q.weight"] == quant.name
    assert gguf.tensor_types["rope_freqs.weight"] == "F32"  # 1-D: kept float32
    loaded = load_model(f"q={path}")
    ids = [int(t) for t in np.random.default_rng(0).integers(0, loaded.vocab_size, 200)]
    hidden = loaded.model(mx.array([ids]), loaded.model.make_cache(), every_position=True)
    got = np.array(loaded.model.logits(hidden)[0])
    ref = reference.forward(gguf, ids, every_position=True)
    r = float(np.abs(got - ref).max() / np.abs(ref).max())
    assert r <= QUANT_BOUND, f"{r:.3g}"


def test_every_type_the_gguf_package_dequantizes_is_supported():
    names = {t.name for t in supported_tensor_types()}
    assert {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K",
            "Q6_K", "I32"} <= names
    assert "Q8_K" not in names  # the gguf package has no dequantizer for it


def test_an_unsupported_tensor_type_names_the_tensor(tmp_path):
    path = tmp_path / "q8k.gguf"
    writer = GGUFWriter(str(path), "llama")
    block_bytes = 292  # one Q8_K block: 256 values
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((2, block_bytes), np.uint8),
                      raw_dtype=Q.Q8_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"tensor 'blk.0.attn_q.weight' has unsupported type "
                                        r"Q8_K \(supported: BF16, F16, F32, "):
        read_gguf(path).tensor("blk.0.attn_q.weight")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return read_gguf(write_tiny_llama(tmp_path_factory.mktemp("g") / "qwen3.gguf", QWEN3_TINY))


@pytest.mark.parametrize("changes, message", [
    ({"rope__scaling__type": "yarn"}, "rope scaling type 'yarn' is not supported"),
    ({"rope__dimension_count": 64}, "rotary dims 64 must be equal"),
    ({"attention__value_length": 64}, "value width 64"),
    ({"attention__head_count": [2, 4, 2, 2]}, r"per-layer head counts \[2, 4, 2, 2\]"),
    ({"attention__head_count_kv": 3}, "2 query heads do not group over 3 KV heads"),
    ({"attention__sliding_window": 8, "attention__sliding_window_pattern": [True]},
     "sliding_window_pattern has 1 entries for 4 layers"),
])  # fmt: skip
def test_variants_not_implemented_are_named(qwen3, changes, message):
    with pytest.raises(GGUFError, match=message):
        llama.ModelArgs.from_gguf(with_metadata(qwen3, **changes))


def test_metadata_variants_read(qwen3):
    args = llama.ModelArgs.from_gguf(with_metadata(
        qwen3, attention__head_count=[2] * 4, rope__scaling__type="none",
        rope__scaling__factor=4.0, attention__sliding_window=8,
        attention__sliding_window_pattern=3))
    assert args.num_attention_heads == 2 and args.rope_scale == 1.0
    assert args.sliding_layers == (True, True, False, True)  # llama.cpp's set_swa_pattern(3)
    assert llama.ModelArgs.from_gguf(with_metadata(
        qwen3, rope__scaling__factor=4.0)).rope_scale == 0.25  # linear is llama.cpp's default
    long = llama.ModelArgs.from_gguf(with_metadata(qwen3, attention__sliding_window=1 << 20))
    assert [s.window for s in long.layer_specs()] == [None] * 4  # never binds: no ring


def test_a_tensor_the_module_would_not_use_is_an_error(tmp_path):
    def add_output_bias(writer):
        writer.add_tensor("output.bias", np.zeros(300, np.float32))

    path = write_tiny_llama(tmp_path / "extra.gguf", LLAMA_TINY, edit=add_output_bias)
    with pytest.raises(GGUFError, match=r"tensor 'output.bias' \(of 1 unused\) is not part "):
        load_model(f"x={path}")


def test_another_architecture_is_refused_by_the_module(qwen3):
    with pytest.raises(GGUFError, match="architecture 'gemma3' is not one of"):
        llama.ModelArgs.from_gguf(replace(qwen3, metadata={**qwen3.metadata,
                                                           "general.architecture": "gemma3"}))
