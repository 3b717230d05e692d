"""A read GGUF with some of its architecture's metadata changed, for the loaders' tests."""

from __future__ import annotations

from dataclasses import replace

from model.gguf.reader import GGUFFile


def with_metadata(gguf: GGUFFile, **changes) -> GGUFFile:
    """`gguf` as if its ``{architecture}.*`` keys had `changes` (a key's dots written as
    double underscores: ``rope__scaling__factor=8.0``); its tensors are the same."""
    meta = dict(gguf.metadata)
    meta.update({f"{gguf.architecture}.{k.replace('__', '.')}": v for k, v in changes.items()})
    return replace(gguf, metadata=meta)
