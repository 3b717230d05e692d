"""Tiny synthetic GGUF models, written with `gguf.GGUFWriter`, for fast process-level tests.

Each has the architecture, metadata keys, tensor names and tokenizer format of the real
files, small dims and random weights from a fixed seed, so every process that writes one
writes the same bytes. Sliding windows, where a model has them, are small (16 tokens) so
short prompts wrap them.
"""

from .deepseek4 import (
    DEEPSEEK4_TINY,
    DEEPSEEK4_TINY_NAME,
    tiny_deepseek4_path,
    write_tiny_deepseek4,
)
from .gemma3 import GEMMA3_TINY_NAME, tiny_gemma3_path, write_tiny_gemma3
from .llama import TINY_LLAMAS, TinyLlama, tiny_llama_path, write_tiny_llama

__all__ = [
    "DEEPSEEK4_TINY",
    "DEEPSEEK4_TINY_NAME",
    "GEMMA3_TINY_NAME",
    "TINY_LLAMAS",
    "TinyLlama",
    "tiny_deepseek4_path",
    "tiny_gemma3_path",
    "tiny_llama_path",
    "write_tiny_deepseek4",
    "write_tiny_gemma3",
    "write_tiny_llama",
]
