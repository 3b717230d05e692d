"""Independent float64 NumPy reference of the Llama family's forward pass (``llama``,
``qwen2``, ``qwen3`` GGUFs), the whole prompt in one pass (`forward`).

Written from the equations of llama.cpp's graphs (``src/models/llama.cpp``, ``qwen2.cpp``,
``qwen3.cpp``) and ggml's RoPE (``ggml_rope_ext``), not from the MLX model, so the two check
each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from model.gguf.reader import GGUFFile

NEOX = frozenset({"qwen2", "qwen3"})


@dataclass(frozen=True)
class Config:
    arch: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float
    base: float
    position_scale: float
    window: int
    sliding: tuple[bool, ...]


def load_config(gguf: GGUFFile) -> Config:
    """The forward's constants from `gguf`'s metadata (llama.cpp's defaults where absent)."""
    arch, meta = gguf.architecture, gguf.metadata

    def get(name, default=None):
        return meta.get(f"{arch}.{name}", default)

    n_layers, n_heads = int(get("block_count")), int(get("attention.head_count"))
    factor = float(get("rope.scaling.factor", 0.0)) if get("rope.scaling.type") == "linear" else 0
    window = int(get("attention.sliding_window", 0))
    pattern = get("attention.sliding_window_pattern")
    sliding = tuple(bool(window) for _ in range(n_layers)) if pattern is None else tuple(
        bool(p) for p in pattern)
    return Config(
        arch=arch, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=int(get("attention.key_length", int(get("embedding_length")) // n_heads)),
        eps=float(get("attention.layer_norm_rms_epsilon")),
        base=float(get("rope.freq_base", 10000.0)),
        position_scale=1.0 / factor if factor else 1.0, window=window, sliding=sliding,
    )  # fmt: skip


class _Weights:
    """Tensors of one GGUF as float64, read once; None for an absent optional one."""

    def __init__(self, gguf: GGUFFile):
        self.gguf, self.cache = gguf, {}

    def __call__(self, name: str, optional: bool = False) -> np.ndarray | None:
        if optional and not self.gguf.has_tensor(name):
            return None
        if name not in self.cache:
            self.cache[name] = self.gguf.tensor(name).astype(np.float64)
        return self.cache[name]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def linear(w: _Weights, name: str, x: np.ndarray) -> np.ndarray:
    y = x @ w(name + ".weight").T
    bias = w(name + ".bias", optional=True)
    return y if bias is None else y + bias


def rope_angles(cfg: Config, factors: np.ndarray | None, n: int) -> np.ndarray:
    """(n, d/2) angles: position p, pair i -> p * s * base^(-2i/d) / f_i."""
    d = cfg.head_dim
    theta = cfg.base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    if factors is not None:
        theta = theta / factors
    return (np.arange(n, dtype=np.float64) * cfg.position_scale)[:, None] * theta[None, :]


def apply_rope(x: np.ndarray, angles: np.ndarray, neox: bool) -> np.ndarray:
    """Rotate `x` (n, heads, d) by `angles` (n, d/2): NEOX pairs (i, i + d/2), else
    NORM pairs (2i, 2i + 1)."""
    d = x.shape[-1]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    a, b = (x[..., : d // 2], x[..., d // 2 :]) if neox else (x[..., 0::2], x[..., 1::2])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    out = np.empty_like(x)
    if neox:
        out[..., : d // 2], out[..., d // 2 :] = ra, rb
    else:
        out[..., 0::2], out[..., 1::2] = ra, rb
    return out


def attention(cfg: Config, w: _Weights, p: str, x: np.ndarray, angles: np.ndarray,
              window: int) -> np.ndarray:
    n, d, H, K = x.shape[0], cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    q = linear(w, p + "attn_q", x).reshape(n, H, d)
    k = linear(w, p + "attn_k", x).reshape(n, K, d)
    v = linear(w, p + "attn_v", x).reshape(n, K, d)
    q_norm = w(p + "attn_q_norm.weight", optional=True)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, cfg.eps), rms_norm(k, w(p + "attn_k_norm.weight"), cfg.eps)
    q, k = apply_rope(q, angles, cfg.arch in NEOX), apply_rope(k, angles, cfg.arch in NEOX)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    visible = (j <= i) & ((i - j < window) if window else True)
    out = np.empty((n, H, d))
    for h in range(H):
        kv = h // (H // K)
        scores = q[:, h] @ k[:, kv].T / np.sqrt(d)
        scores = np.where(visible, scores, -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[:, h] = (probs / probs.sum(axis=-1, keepdims=True)) @ v[:, kv]
    return linear(w, p + "attn_output", out.reshape(n, H * d))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def forward(gguf: GGUFFile, ids: list[int], every_position: bool = False) -> np.ndarray:
    """Logits float64: of the last position ``(vocab,)``, or of every one ``(n, vocab)``.

    Every dimension and option comes from the GGUF's metadata and tensors:

    * x = token_embd[ids]; per block: x += attn(rms(x) * attn_norm); x += ffn(rms(x) *
      ffn_norm); logits = (rms(x) * output_norm) @ output^T (``output.weight``, or
      ``token_embd`` if absent).
    * attn: q = x Wq^T (+ bq), k, v likewise, split into heads; q/k RMS-normed per head when
      ``attn_q_norm`` exists (before RoPE); RoPE on q and k; softmax(q k^T / sqrt(d) + mask)
      v, query head h reading KV head ``h // (n_heads / n_kv_heads)``; out = o Wo^T (+ bo).
    * RoPE, pair i of d/2 at position p: angle = p * s * base^(-2i/d) / f_i, with s = 1 / the
      linear ``rope.scaling.factor`` (1 without) and f = ``rope_freqs`` (1 without); pairs
      (x[2i], x[2i+1]) for ``llama`` (NORM), (x[i], x[i + d/2]) for ``qwen2``/``qwen3`` (NEOX).
    * mask: causal; on sliding layers also p - j < window.
    * ffn: down(silu(gate(x)) * up(x)) (+ biases where present).
    """
    cfg, w = load_config(gguf), _Weights(gguf)
    angles = rope_angles(cfg, w("rope_freqs.weight", optional=True), len(ids))
    x = w("token_embd.weight")[np.asarray(ids)]
    for layer in range(cfg.n_layers):
        p = f"blk.{layer}."
        window = cfg.window if cfg.sliding[layer] else 0
        x = x + attention(cfg, w, p, rms_norm(x, w(p + "attn_norm.weight"), cfg.eps), angles,
                          window)
        h = rms_norm(x, w(p + "ffn_norm.weight"), cfg.eps)
        x = x + linear(w, p + "ffn_down", silu(linear(w, p + "ffn_gate", h)) *
                       linear(w, p + "ffn_up", h))
    x = rms_norm(x, w("output_norm.weight"), cfg.eps)
    head = w("output.weight", optional=True)
    logits = x @ (w("token_embd.weight") if head is None else head).T
    return logits if every_position else logits[-1]
