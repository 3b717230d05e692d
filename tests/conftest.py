"""Shared fixtures: the real Gemma 3 270M model (loaded once per session) and its reference data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def reference_cases() -> list[dict]:
    """llama.cpp's token ids and top-10 final logits for Gemma 3 270M (tests/data)."""
    return json.loads((DATA / "gemma3-270m-llamacpp.json").read_text())["cases"]


@pytest.fixture(scope="session")
def gemma():
    """The real Gemma 3 270M Q4_K_M model, float32 on CPU (a `model.registry.LoadedModel`)."""
    from model.registry import load_model

    return load_model("gemma3-270m")
