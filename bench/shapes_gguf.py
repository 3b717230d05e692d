"""python -m bench.shapes_gguf PATH: write a GGUF of Gemma 3 270M's shapes with random weights
(`bench.gpu.GEMMA3_270M`: 18 layers 640 wide, 4 heads of 256, a 262,144-token embedding and
head), for serving through a worker (``prefillq worker --model NAME=PATH``) where the real
model's file cannot travel: `bench.serve --model gemma3-270m-shapes=PATH` on a lent GPU.

The tokenizer is the tiny Gemma 3's, padded with unused pieces to the vocabulary's size
(`model.gguf.synthetic.gemma3.write_tiny_gemma3`); float32 weights, ~1.1 GB.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from model.gguf.synthetic.gemma3 import write_tiny_gemma3

from .gpu import GEMMA3_270M


def write_gemma3_270m_shapes(path: str | Path) -> Path:
    """Write the random-weight Gemma 3 270M-shape GGUF to `path` (seed 0); returns it."""
    a = GEMMA3_270M
    return write_tiny_gemma3(
        path, hidden=a.hidden_size, n_layers=a.num_hidden_layers,
        n_heads=a.num_attention_heads, n_kv_heads=a.num_key_value_heads, head_dim=a.head_dim,
        ffn=a.intermediate_size, sliding_window=a.sliding_window,
        context_length=a.context_length, vocab_size=a.vocab_size)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.shapes_gguf", description=__doc__)
    p.add_argument("path", type=Path, help="the GGUF to write")
    print(write_gemma3_270m_shapes(p.parse_args(argv).path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
