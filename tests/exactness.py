"""The exactness contract every prefill path is tested against (docs/architecture.md,
Tests): float32 max |diff| <= 1e-3 x max |logit| and the same argmax, plus a regression
bound near what the test measured."""

from __future__ import annotations

import numpy as np

EXACT_RTOL = 1e-3


def assert_contract(out: np.ndarray, ref: np.ndarray, bound: float) -> float:
    """Assert the contract and ``max |diff| <= bound x max |logit|`` for logits `out`
    against `ref` (float32 ``(vocab,)``); returns the measured fraction."""
    scale = float(np.abs(ref).max())
    diff = float(np.abs(out - ref).max())
    assert diff <= EXACT_RTOL * scale
    assert diff <= bound * scale, f"max |diff| {diff / scale:.3g} x max|logit| > {bound}"
    assert int(out.argmax()) == int(ref.argmax())
    return diff / scale
