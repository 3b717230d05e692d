"""model.gguf.weights (through model.gguf.reader): a real Q4_1 tensor loads as llama.cpp's
block layout defines it, and a tensor of an unsupported type is refused by name."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize

from model.gguf.reader import GGUFError, read_gguf
from model.gguf.synthetic.common import finish
from model.gguf.weights import load_gguf_weights

# ggml-common.h ``block_q4_1``: fp16 scale d, fp16 minimum m, then 32 4-bit values packed two
# to a byte (element j in the low nibble of byte j, element j + 16 in its high nibble).
Q4_1_BLOCK = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)])
Q4_1_NAME = "blk.0.attn_q.weight"


class _OneLinear(nn.Module):
    def __init__(self, in_dims: int, out_dims: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_dims, out_dims, bias=False)


def _q4_1_reference(raw: np.ndarray) -> np.ndarray:
    """Q4_1 rows of bytes -> float32 values, from the block layout alone."""
    blocks = np.ascontiguousarray(raw).view(Q4_1_BLOCK).reshape(raw.shape[0], -1)
    low, high = blocks["qs"] & 0x0F, blocks["qs"] >> 4
    q = np.concatenate([low, high], axis=-1).astype(np.float32)  # (rows, blocks, 32)
    d = blocks["d"].astype(np.float32)[..., None]
    m = blocks["m"].astype(np.float32)[..., None]
    return (d * q + m).reshape(raw.shape[0], -1)


@pytest.fixture(scope="module")
def smollm2_path():
    from model.registry import smollm2_135m_path

    return smollm2_135m_path()[0]


@pytest.mark.slow
def test_a_q4_1_tensor_loads_as_its_blocks_say(smollm2_path):
    gguf = read_gguf(smollm2_path)
    assert gguf.tensor_types[Q4_1_NAME] == "Q4_1"
    raw = next(t for t in GGUFReader(smollm2_path).tensors if t.name == Q4_1_NAME)
    model = load_gguf_weights(_OneLinear(576, 576), gguf, lambda name: Q4_1_NAME, mx.float32)
    loaded = np.array(model.proj.weight)
    assert loaded.shape == (576, 576)  # (out, in): GGUF's ne0 is the input dimension
    # float32 multiply-add in the same order on both sides: equal to the bit
    np.testing.assert_array_equal(loaded, dequantize(raw.data, GGMLQuantizationType.Q4_1))
    np.testing.assert_array_equal(loaded, _q4_1_reference(np.asarray(raw.data)))
    assert np.unique(loaded[0, :32]).size <= 16  # one block: 16 levels at most


def test_an_unsupported_tensor_type_is_named(tmp_path):
    path = tmp_path / "q8k.gguf"
    writer = GGUFWriter(str(path), "llama")
    # one Q8_K block (292 bytes, 256 values): the gguf package does not dequantize Q8_K
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((1, 292), dtype=np.uint8),
                      raw_dtype=GGMLQuantizationType.Q8_K)
    finish(writer, path)
    with pytest.raises(GGUFError, match=r"tensor 'blk.0.attn_q.weight' has unsupported type "
                                        r"Q8_K"):
        load_gguf_weights(_OneLinear(256, 1), read_gguf(path),
                          lambda name: "blk.0.attn_q.weight", mx.float32)
