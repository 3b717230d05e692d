"""Independent float64 NumPy reference of the DeepSeek-V4 forward pass, whole prompt in one pass.

Written from the equations of the DeepSeek-V4 reference `inference/model.py` + `kernel.py`
("REF", shipped in deepseek-ai's DeepSeek-V4 Hugging Face repositories), not from the MLX
model, so the two can check each other; `reference_logits` lists what it leaves out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from model.gguf.reader import GGUFError, GGUFFile


@dataclass(frozen=True)
class Config:
    """The `deepseek4.*` metadata the forward needs (names as in docs/deepseek4-tiny.md)."""

    n_layers: int
    hidden: int
    n_heads: int
    head_dim: int
    rope_dim: int
    rope_base: float
    compress_rope_base: float
    yarn_factor: float
    yarn_orig_ctx: int
    yarn_beta_fast: float
    yarn_beta_slow: float
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    window: int
    compress_ratios: tuple[int, ...]
    index_heads: int
    index_head_dim: int
    index_top_k: int
    n_experts: int
    n_used: int
    weights_scale: float
    weights_norm: bool
    hash_layers: int
    swiglu_limits: tuple[float, ...]
    hc: int
    sinkhorn_iters: int
    hc_eps: float
    rms_eps: float


def load_config(gguf: GGUFFile) -> Config:
    """Read the config from `gguf`'s metadata. Raises GGUFError naming a missing key."""

    def get(name: str, default: Any = None) -> Any:
        key = f"{gguf.architecture}.{name}"
        if key not in gguf.metadata and default is None:
            raise GGUFError(f"{gguf.path.name}: missing metadata key {key!r}")
        return gguf.metadata.get(key, default)

    n_layers = int(get("block_count"))
    limit = get("swiglu_clamp_exp", 0.0)  # a scalar, or one value per layer
    limits = (
        tuple(float(v) for v in limit) if isinstance(limit, list) else (float(limit),) * n_layers
    )
    ratios = tuple(int(r) for r in get("attention.compress_ratios"))[:n_layers]
    return Config(
        n_layers=n_layers,
        hidden=int(get("embedding_length")),
        n_heads=int(get("attention.head_count")),
        head_dim=int(get("attention.key_length")),
        rope_dim=int(get("rope.dimension_count")),
        rope_base=float(get("rope.freq_base")),
        compress_rope_base=float(get("attention.compress_rope_freq_base")),
        yarn_factor=float(get("rope.scaling.factor")),
        yarn_orig_ctx=int(get("rope.scaling.original_context_length")),
        yarn_beta_fast=float(get("rope.scaling.yarn_beta_fast")),
        yarn_beta_slow=float(get("rope.scaling.yarn_beta_slow")),
        q_lora_rank=int(get("attention.q_lora_rank")),
        o_lora_rank=int(get("attention.output_lora_rank")),
        o_groups=int(get("attention.output_group_count")),
        window=int(get("attention.sliding_window")),
        compress_ratios=ratios,
        index_heads=int(get("attention.indexer.head_count")),
        index_head_dim=int(get("attention.indexer.key_length")),
        index_top_k=int(get("attention.indexer.top_k")),
        n_experts=int(get("expert_count")),
        n_used=int(get("expert_used_count")),
        weights_scale=float(get("expert_weights_scale")),
        weights_norm=bool(get("expert_weights_norm")),
        hash_layers=int(get("hash_layer_count")),
        swiglu_limits=limits,
        hc=int(get("hyper_connection.count")),
        sinkhorn_iters=int(get("hyper_connection.sinkhorn_iterations")),
        hc_eps=float(get("hyper_connection.epsilon")),
        rms_eps=float(get("attention.layer_norm_rms_epsilon")),
    )


# ------------------------------------------------------------------------------ basic ops


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if weight is None else y * weight


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def rope_frequencies(cfg: Config, compressed: bool) -> np.ndarray:
    """Per-pair angular frequencies (rope_dim/2,), radians per position.

    Ratio-0 layers: base `rope.freq_base`, no YaRN. Ratio>0 layers: base
    `attention.compress_rope_freq_base` with YaRN frequency interpolation, exactly REF
    `precompute_freqs_cis` (DeepSeek-V4 inference/model.py): with
    corr(b) = d*ln(orig/(2*pi*b)) / (2*ln(base)), low = max(floor(corr(beta_fast)), 0),
    high = min(ceil(corr(beta_slow)), d-1), ramp_i = clip((i - low)/(high - low), 0, 1) over the
    d/2 pair indices i, smooth = 1 - ramp: freq_i = freq_i/factor*(1-smooth_i) + freq_i*smooth_i.
    No YaRN mscale/temperature is applied anywhere.
    """
    d = cfg.rope_dim
    base = cfg.compress_rope_base if compressed else cfg.rope_base
    freqs = 1.0 / base ** (np.arange(0, d, 2, dtype=np.float64) / d)
    if not compressed:
        return freqs

    def corr_dim(rotations: float) -> float:
        return d * math.log(cfg.yarn_orig_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(cfg.yarn_beta_fast)), 0)
    high = min(math.ceil(corr_dim(cfg.yarn_beta_slow)), d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    smooth = 1.0 - ramp
    return freqs / cfg.yarn_factor * (1.0 - smooth) + freqs * smooth


def apply_rope(x: np.ndarray, positions: np.ndarray, freqs: np.ndarray, inverse=False):
    """Rotate the LAST 2*len(freqs) dims of `x` as interleaved (even, odd) pairs.

    Args:
        x: (n, ..., d) float64; n matches `positions`.
        positions: (n,) absolute positions (tokens).
        inverse: rotate by the conjugate (undo the rotation).
    """
    rd = 2 * len(freqs)
    angle = positions.astype(np.float64)[:, None] * freqs[None, :]  # (n, rd/2)
    if inverse:
        angle = -angle
    angle = angle.reshape(angle.shape[:1] + (1,) * (x.ndim - 2) + angle.shape[1:])
    cos, sin = np.cos(angle), np.sin(angle)
    out = x.copy()
    even, odd = x[..., -rd::2], x[..., -rd + 1 :: 2]
    out[..., -rd::2] = even * cos - odd * sin
    out[..., -rd + 1 :: 2] = even * sin + odd * cos
    return out


def sinkhorn(logits: np.ndarray, iters: int, eps: float) -> np.ndarray:
    """mHC comb matrices (..., hc, hc): row softmax + eps, column-normalise, then `iters-1` x
    (row, column) normalisation, each dividing by (sum + eps). REF kernel `hc_split_sinkhorn`."""
    comb = softmax(logits, axis=-1) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    return comb


# ------------------------------------------------------------------------------ the model


class _Weights:
    """Tensors of one GGUF as float64 (int tables stay integer), read once."""

    def __init__(self, gguf: GGUFFile):
        self.gguf, self.cache = gguf, {}

    def __call__(self, name: str) -> np.ndarray:
        if name not in self.cache:
            t = self.gguf.tensor(name)
            self.cache[name] = t if t.dtype.kind in "iu" else t.astype(np.float64)
        return self.cache[name]

    def has(self, name: str) -> bool:
        return self.gguf.has_tensor(name)


def hc_mixes(h: np.ndarray, fn: np.ndarray, eps: float) -> np.ndarray:
    """(n, hc, H) -> (n, m): flat @ fn^T scaled by the weightless RMS of the flat stream."""
    flat = h.reshape(h.shape[0], -1)
    return (flat @ fn.T) / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + eps)


def hc_pre(cfg: Config, w: _Weights, name: str, h: np.ndarray):
    """mHC split (REF `hc_split_sinkhorn`): returns sublayer input (n, H), post (n, hc),
    comb (n, hc, hc)."""
    hc = cfg.hc
    fn, base, scale = (w(f"{name}_{p}.weight") for p in ("fn", "base", "scale"))
    mixes = hc_mixes(h, fn, cfg.rms_eps)
    pre = sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + cfg.hc_eps
    post = 2.0 * sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    logits = (mixes[:, 2 * hc :] * scale[2] + base[2 * hc :]).reshape(-1, hc, hc)
    comb = sinkhorn(logits, cfg.sinkhorn_iters, cfg.hc_eps)
    return np.einsum("ni,nid->nd", pre, h), post, comb


def hc_post(out: np.ndarray, h: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """new h_j = post_j * out + sum_i comb[i, j] * h_i  -> (n, hc, H)."""
    return post[:, :, None] * out[:, None, :] + np.einsum("nij,nid->njd", comb, h)


def compress(x, kv_w, gate_w, ape, norm_w, ratio, d, freqs, eps) -> np.ndarray:
    """Gated-pooling compressor (REF `Compressor`): (n, H) -> (n // ratio, d).

    Row j pools window j (tokens j*r..j*r+r-1); for ratio 4 (overlap) it pools the A-halves
    (first d features) of window j-1 and the B-halves of window j, 2r candidates, j = 0 having
    no A part. Softmax per feature column over the candidates of score = wgate(x) + ape[t % r].
    Then RMSNorm and RoPE at position j*r on the last rope dims.
    """
    n_rows = x.shape[0] // ratio
    if n_rows == 0:
        return np.zeros((0, d))
    t = np.arange(n_rows * ratio)
    kv = (x[: len(t)] @ kv_w.T).reshape(n_rows, ratio, -1)
    score = (x[: len(t)] @ gate_w.T + ape[t % ratio]).reshape(n_rows, ratio, -1)
    if ratio == 4:
        pad_kv, pad_score = np.zeros((1, ratio, d)), np.full((1, ratio, d), -np.inf)
        kv = np.concatenate([np.concatenate([pad_kv, kv[:-1, :, :d]]), kv[:, :, d:]], axis=1)
        score = np.concatenate(
            [np.concatenate([pad_score, score[:-1, :, :d]]), score[:, :, d:]], axis=1
        )
    rows = np.sum(softmax(score, axis=1) * kv, axis=1)  # (n_rows, d)
    rows = rms_norm(rows, norm_w, eps)
    return apply_rope(rows, np.arange(n_rows) * ratio, freqs)


def indexer_select(cfg, w, prefix, x, qr, freqs, trace) -> np.ndarray:
    """Lightning indexer (REF `Indexer`): bool (n, n_rows), the compressed rows each query uses.

    score(p, j) = sum_h w[p,h] * relu(q_I[p,h] . K_I[j]) over visible rows j < (p+1)//4, top
    k = min(top_k, visible). Ties keep the lower row index (stable sort); `trace` records the
    smallest gap between the k-th and (k+1)-th score so a caller can check there is no tie.
    """
    n, ih, ihd, ratio = x.shape[0], cfg.index_heads, cfg.index_head_dim, 4
    q = (qr @ w(prefix + "indexer.attn_q_b.weight").T).reshape(n, ih, ihd)
    q = apply_rope(q, np.arange(n), freqs)
    keys = compress(
        x, w(prefix + "indexer_compressor_kv.weight"), w(prefix + "indexer_compressor_gate.weight"),
        w(prefix + "indexer_compressor_ape.weight"), w(prefix + "indexer_compressor_norm.weight"),
        ratio, ihd, freqs, cfg.rms_eps,
    )  # fmt: skip
    weights = (x @ w(prefix + "indexer.proj.weight").T) * ihd**-0.5 * ih**-0.5  # (n, ih)
    dots = np.einsum("nhd,jd->nhj", q, keys)
    scores = np.einsum("nh,nhj->nj", weights, np.maximum(dots, 0))
    visible = np.arange(len(keys))[None, :] < ((np.arange(n) + 1) // ratio)[:, None]
    selected = np.zeros_like(visible)
    min_gap = np.inf
    for t in range(n):
        n_vis = int(visible[t].sum())
        k = min(cfg.index_top_k, n_vis)
        order = np.argsort(-scores[t, :n_vis], kind="stable")
        selected[t, order[:k]] = True
        if n_vis > k:
            min_gap = min(min_gap, scores[t, order[k - 1]] - scores[t, order[k]])
    if trace is not None:
        trace.setdefault("indexer", []).append(
            {"visible": visible.sum(1), "selected": selected, "min_gap": min_gap,
             "scores": scores, "weights": weights, "dots": dots}
        )  # fmt: skip
    return selected


def attention(cfg: Config, w: _Weights, layer: int, x: np.ndarray, trace) -> np.ndarray:
    """One attention sublayer over the whole prompt: (n, H) -> (n, H). REF `Attention`."""
    p, n = f"blk.{layer}.", x.shape[0]
    nh, hd, ratio, eps = cfg.n_heads, cfg.head_dim, cfg.compress_ratios[layer], cfg.rms_eps
    pos = np.arange(n)
    freqs = rope_frequencies(cfg, compressed=ratio > 0)
    qr = rms_norm(x @ w(p + "attn_q_a.weight").T, w(p + "attn_q_a_norm.weight"), eps)
    q = (qr @ w(p + "attn_q_b.weight").T).reshape(n, nh, hd)
    q = apply_rope(rms_norm(q, None, eps), pos, freqs)  # weightless per-head RMS, then RoPE
    kv = rms_norm(x @ w(p + "attn_kv.weight").T, w(p + "attn_kv_a_norm.weight"), eps)
    kv = apply_rope(kv, pos, freqs)  # (n, hd): key and value of the single KV head

    keys = kv
    window = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - cfg.window)
    allowed = window  # (n queries, keys)
    if ratio:
        rows = compress(
            x, w(p + "attn_compressor_kv.weight"), w(p + "attn_compressor_gate.weight"),
            w(p + "attn_compressor_ape.weight"), w(p + "attn_compressor_norm.weight"),
            ratio, hd, freqs, eps,
        )  # fmt: skip
        if ratio == 4:
            used = indexer_select(cfg, w, p, x, qr, freqs, trace)
        else:
            used = np.arange(len(rows))[None, :] < ((pos + 1) // ratio)[:, None]
        keys = np.concatenate([kv, rows])
        allowed = np.concatenate([window, used], axis=1)

    scores = np.einsum("nhd,kd->nhk", q, keys) * hd**-0.5
    scores = np.where(allowed[:, None, :], scores, -np.inf)
    sink = w(p + "attn_sinks.weight")[None, :]  # (1, nh): exp(sink) joins the denominator only
    m = np.maximum(scores.max(axis=-1), sink)
    e = np.exp(scores - m[..., None])
    o = np.einsum("nhk,kd->nhd", e, keys) / (e.sum(-1) + np.exp(sink - m))[..., None]
    o = apply_rope(o, pos, freqs, inverse=True)

    og = cfg.o_groups
    wo_a = w(p + "attn_output_a.weight").reshape(og, cfg.o_lora_rank, -1)
    o = np.einsum("ngd,grd->ngr", o.reshape(n, og, -1), wo_a).reshape(n, -1)
    return o @ w(p + "attn_output_b.weight").T


def _swiglu(x, gate_w, up_w, down_w, limit: float, weight=None) -> np.ndarray:
    gate, up = x @ gate_w.T, x @ up_w.T
    if limit > 0:
        gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
    h = gate * sigmoid(gate) * up
    if weight is not None:
        h = h * weight[:, None]
    return h @ down_w.T


def moe(cfg, w, layer: int, x: np.ndarray, token_ids: np.ndarray, trace) -> np.ndarray:
    """Routed experts + one shared expert (REF `Gate`/`MoE`): (n, H) -> (n, H)."""
    p, k, limit = f"blk.{layer}.", cfg.n_used, cfg.swiglu_limits[layer]
    scores = np.sqrt(np.logaddexp(0.0, x @ w(p + "ffn_gate_inp.weight").T))  # sqrt(softplus)
    if layer < cfg.hash_layers:
        ids = w(p + "ffn_gate_tid2eid.weight")[token_ids].astype(np.int64)
    else:
        biased = scores + w(p + "exp_probs_b.bias")  # selection only
        order = np.argsort(-biased, axis=-1, kind="stable")
        ids = order[:, :k]
        if trace is not None and cfg.n_experts > k:
            gap = np.take_along_axis(biased, order[:, k - 1 : k + 1], axis=-1)
            trace.setdefault("router_min_gap", []).append(float(np.min(gap[:, 0] - gap[:, 1])))
    weights = np.take_along_axis(scores, ids, axis=-1)
    if cfg.weights_norm:
        weights = weights / weights.sum(-1, keepdims=True)
    weights = weights * cfg.weights_scale
    out = np.zeros_like(x)
    gate, up, down = (w(f"{p}ffn_{m}_exps.weight") for m in ("gate", "up", "down"))
    for e in range(cfg.n_experts):
        tok, slot = np.nonzero(ids == e)
        if len(tok):
            out[tok] += _swiglu(x[tok], gate[e], up[e], down[e], limit, weights[tok, slot])
    shared = (w(f"{p}ffn_{m}_shexp.weight") for m in ("gate", "up", "down"))
    return out + _swiglu(x, *shared, limit)


def forward_hidden(gguf: GGUFFile, token_ids: list[int], trace: dict | None = None):
    """The final mHC streams of every position: (n, hc, H) float64."""
    cfg, w = load_config(gguf), _Weights(gguf)
    ids = np.asarray(token_ids, dtype=np.int64)
    h = np.repeat(w("token_embd.weight")[ids][:, None, :], cfg.hc, axis=1)  # (n, hc, H)
    for layer in range(cfg.n_layers):
        p = f"blk.{layer}."
        x, post, comb = hc_pre(cfg, w, p + "hc_attn", h)
        out = attention(cfg, w, layer, rms_norm(x, w(p + "attn_norm.weight"), cfg.rms_eps), trace)
        h = hc_post(out, h, post, comb)
        if trace is not None:
            trace.setdefault("comb", []).append(comb)
        x, post, comb = hc_pre(cfg, w, p + "hc_ffn", h)
        out = moe(cfg, w, layer, rms_norm(x, w(p + "ffn_norm.weight"), cfg.rms_eps), ids, trace)
        h = hc_post(out, h, post, comb)
        if trace is not None:
            trace["comb"].append(comb)
    return h


def head_logits(gguf: GGUFFile, h: np.ndarray) -> np.ndarray:
    """mHC head + output norm + lm head: (n, hc, H) -> (n, V) float64. REF `Transformer`."""
    cfg, w = load_config(gguf), _Weights(gguf)
    mixes = hc_mixes(h, w("output_hc_fn.weight"), cfg.rms_eps)
    pre = sigmoid(mixes * w("output_hc_scale.weight")[0] + w("output_hc_base.weight")) + cfg.hc_eps
    y = rms_norm(np.einsum("ni,nid->nd", pre, h), w("output_norm.weight"), cfg.rms_eps)
    return y @ w("output.weight").T


def reference_logits(gguf: GGUFFile, token_ids: list[int], trace: dict | None = None):
    """Final-position logits of the prompt `token_ids`, computed in one float64 pass.

    Every dimension comes from the GGUF metadata (``deepseek4.*``), so this runs on the tiny
    synthetic model and on a real Flash GGUF (slowly: O(n^2) per layer). Left out, none of
    which changes the math being checked: REF's QAT simulation (FP8/FP4 quant->dequant of
    activations and cached rows); the indexer's Hadamard rotation (orthogonal and applied to
    both q_I and K_I, so q_I . K_I is unchanged; REF `Indexer`); the MTP block.

    Args:
        gguf: an opened `deepseek4` GGUF (tiny synthetic or real).
        token_ids: the prompt, at least one token id.
        trace: optional dict filled with internals for tests: "comb" (per sublayer
            (n, hc, hc) Sinkhorn matrices), "indexer" (per ratio-4 layer: visible rows,
            selection, min top-k score gap), "router_min_gap" (per non-hash layer).

    Returns:
        (V,) float64 logits.
    """
    return head_logits(gguf, forward_hidden(gguf, token_ids, trace)[-1:])[0]


def reference_all_logits(gguf: GGUFFile, token_ids: list[int]) -> np.ndarray:
    """Logits of every prompt position, (n, V) float64 (for chunked-prefill checks)."""
    return head_logits(gguf, forward_hidden(gguf, token_ids))
