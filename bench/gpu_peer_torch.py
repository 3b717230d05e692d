"""A torch peer of `python -m bench.gpu`, alone in its process (MLX is never imported):

    python -m bench.gpu_peer_torch attention --backend NAME [--heads 4] [--kv-heads 1]
        [--head-dim 256] [--repeats 5] [--device cuda] QUERIES [QUERIES ...]
    python -m bench.gpu_peer_torch hf --attn {sdpa,flex_attention,eager} [--backend NAME]
        --shapes JSON [--repeats 3] [--device cuda] N [N ...]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time

from .common import causal_attention_flops, log
from .gpu_peers import (
    DEFAULT_BACKEND,
    HF_EAGER,
    HF_FLEX,
    HF_SDPA,
    SDPA_BACKENDS,
    TORCH_SDPA,
    child_recorder,
    finish_child,
    measure,
    parse_shapes,
    process_label,
    rope_scaling,
)

HF_IMPLS = {"sdpa": HF_SDPA, "flex_attention": HF_FLEX, "eager": HF_EAGER}
# Bytes a materialized score costs at once: bf16 scores, fp32 softmax, bf16 probabilities
# and the mask's share, with room to spare; asked of at most `FREE_SHARE` of free memory.
SCORE_BYTES = 12
FREE_SHARE = 0.8


def scores_fit(heads: int, queries: int, free_bytes: int) -> bool:
    """Whether ``heads x queries x queries`` materialized scores (`SCORE_BYTES` each) fit
    in `FREE_SHARE` of `free_bytes`."""
    return heads * queries * queries * SCORE_BYTES <= FREE_SHARE * free_bytes


def _free_bytes(device: str) -> int | None:
    import torch

    return torch.cuda.mem_get_info()[0] if torch.device(device).type == "cuda" else None


def backend_context(name: str):
    """A context under which SDPA runs only backend `name` (`SDPA_BACKENDS`); none for
    ``default``. Raises KeyError for an unknown name."""
    if name == DEFAULT_BACKEND:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[name]))


def _synchronize(device: str) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def fastest(fn, repeats: int, device: str, batch: int = 1) -> float:
    """Fastest wall seconds a call of `fn` takes, of `repeats` samples after a warm-up call:
    each sample `batch` calls back to back (the launches queue behind each other on the
    device) with the device synchronized around them, over `batch`."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        _synchronize(device)
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        _synchronize(device)
        best = min(best, (time.perf_counter() - t0) / batch)
    return best


def _picked(q, k, v, gqa: bool) -> str | None:
    """The backend torch picks by itself for these inputs (a private torch API, so None
    where it is missing or declines)."""
    import torch
    from torch.nn.attention import SDPBackend

    try:
        return SDPBackend(torch._fused_sdp_choice(q, k, v, is_causal=True,
                                                  enable_gqa=gqa)).name
    except Exception:  # private API: its absence must not cost the measurement
        return None


def attention_cases(rec, backend: str, queries: list[int], heads: int, kv_heads: int,
                    head_dim: int, repeats: int, batch: int = 1, device: str = "cuda") -> None:
    """torch SDPA alone under `backend` at each of `queries`, both KV layouts: ``enable_gqa``
    on the KV heads as they are, and the KV heads expanded to every query head (``expanded
    kv``); ``attention_tflops`` records of the causal work, fastest of `repeats` samples of
    `batch` calls after a warm-up (`fastest`)."""
    import torch
    import torch.nn.functional as F

    for L in queries:
        shape = dict(queries=L, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                     dtype="bfloat16", torch=torch.__version__)
        free = _free_bytes(device)
        if backend == "math" and free is not None and not scores_fit(heads, L, free):
            rec("peer_skipped", 0.0, "none", impl=TORCH_SDPA, **shape,
                reason=f"math scores need ~{heads * L * L * SCORE_BYTES / 2**30:.0f} GiB")
            continue
        q = torch.randn(1, heads, L, head_dim, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(1, kv_heads, L, head_dim, device=device, dtype=torch.bfloat16)
                for _ in range(2))
        expanded = [x.expand(1, heads, L, head_dim).contiguous() for x in (k, v)]
        for layout, kv, gqa in (("enable_gqa", (k, v), True), ("expanded kv", expanded, False)):
            def run(q=q, kv=kv, gqa=gqa):
                with backend_context(backend):
                    return F.scaled_dot_product_attention(q, *kv, is_causal=True,
                                                          enable_gqa=gqa)
            picked = {"picked": _picked(q, *kv, gqa)} if backend == DEFAULT_BACKEND else {}
            log(f"{TORCH_SDPA}, backend {backend}, {layout}, {L} queries")
            measure(rec, "attention_tflops", "TFLOP/s",
                    causal_attention_flops(L, heads, head_dim) / 1e12,
                    lambda run=run: fastest(run, repeats, device, batch), impl=TORCH_SDPA,
                    layout=layout, batch=batch, **shape, **picked)
        _release(device)


def _release(device: str) -> None:
    import torch

    gc.collect()  # a failed call's tensors, before the allocator's cache is emptied
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def hf_config(shapes: dict):
    """HF transformers' config at `shapes` (`bench.gpu_peers.shapes_of`), by ``family``:
    ``Gemma3TextConfig`` (its ``sliding`` layers windowed, RoPE bases as prefillq's, the
    head tied), ``LlamaConfig`` or ``Qwen3Config`` (RoPE scaling as `rope_scaling` gives
    it). Raises KeyError for another family."""
    family = shapes.get("family", "gemma3")
    if family == "gemma3":
        return _gemma3_config(shapes)
    from transformers import LlamaConfig, Qwen3Config

    a = shapes
    rope = {"rope_type": "default", **(rope_scaling(a) or {}), "rope_theta": a["rope_theta"]}
    common = dict(
        vocab_size=a["vocab_size"], hidden_size=a["hidden_size"],
        intermediate_size=a["intermediate_size"], num_hidden_layers=a["num_hidden_layers"],
        num_attention_heads=a["num_attention_heads"],
        num_key_value_heads=a["num_key_value_heads"], head_dim=a["head_dim"],
        rms_norm_eps=a["rms_norm_eps"], max_position_embeddings=a["context_length"],
        tie_word_embeddings=a["tie_word_embeddings"], rope_parameters=rope)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen3":
        return Qwen3Config(**common)
    raise KeyError(f"no HF transformers model for family {family!r}")


def _gemma3_config(shapes: dict):
    """``Gemma3TextConfig`` at `shapes`: the global layers' RoPE linearly scaled where
    prefillq's ``rope_scale`` is not 1 (HF's ``rope_parameters["full_attention"]``, as the
    4B and larger configs carry it), the query scale from ``query_pre_attn_scalar`` (27B)."""
    from transformers import Gemma3TextConfig

    a = shapes
    full = {"rope_type": "default", **(rope_scaling(a) or {}), "rope_theta": a["rope_theta"]}
    return Gemma3TextConfig(
        vocab_size=a["vocab_size"], hidden_size=a["hidden_size"],
        intermediate_size=a["intermediate_size"], num_hidden_layers=a["num_hidden_layers"],
        num_attention_heads=a["num_attention_heads"],
        num_key_value_heads=a["num_key_value_heads"], head_dim=a["head_dim"],
        rms_norm_eps=a["rms_norm_eps"], sliding_window=a["sliding_window"],
        query_pre_attn_scalar=a.get("query_pre_attn_scalar") or a["head_dim"],
        max_position_embeddings=a["context_length"], hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        layer_types=["sliding_attention" if s else "full_attention" for s in a["sliding"]],
        rope_parameters={
            "full_attention": full,
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": a["rope_local_base_freq"]}})


def hf_model(attn_implementation: str, shapes: dict, device: str = "cuda", dtype=None):
    """The causal LM of `hf_config(shapes)`, random init, on `device`, in `dtype`
    (default ``torch.bfloat16``), in eval mode. Raises ImportError without torch or
    transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            hf_config(shapes), attn_implementation=attn_implementation,
            dtype=dtype or torch.bfloat16)
    return model.to(device).eval()


def hf_prefill(model, ids):
    """One pass of int64 ``(1, n)`` `ids` (a torch tensor on the model's device) through HF
    `model`, no KV cache kept; returns the ``(1, vocab)`` final-position logits."""
    import torch

    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1]


def hf_cases(rec, attn: str, backend: str, shapes: dict, lengths: list[int], repeats: int,
             device: str = "cuda") -> None:
    """HF with `attn` attention under SDPA `backend` at each of `lengths` tokens, the head on
    the last position only (``logits_to_keep=1``); ``gpu_prefill_tok_s`` records, fastest of
    `repeats` after a warm-up (which also compiles ``flex_attention``)."""
    import torch
    import transformers

    model = hf_model(attn, shapes, device)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    for n in lengths:
        details = dict(impl=HF_IMPLS[attn], model=shapes.get("label", "gemma3 shapes"),
                       dtype="bfloat16", n_tokens=n, chunk_tokens=n, use_cache=False,
                       logits_to_keep=1, **versions)
        free = _free_bytes(device)
        materializes = attn == "eager" or backend == "math"
        if materializes and free is not None and not scores_fit(
                shapes["num_attention_heads"], n, free):
            rec("peer_skipped", 0.0, "none", **details, reason="scores do not fit")
            continue
        ids = torch.randint(0, shapes["vocab_size"], (1, n), device=device)

        def once(ids=ids):
            with backend_context(backend):
                hf_prefill(model, ids)
        held = backend if attn == "sdpa" else None
        log(f"{process_label(HF_IMPLS[attn], held)}, {n} tokens in one pass")
        measure(rec, "gpu_prefill_tok_s", "tok/s", n,
                lambda once=once: fastest(once, repeats, device), **details)
        _release(device)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_peer_torch")
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("attention", help="torch SDPA alone")
    a.add_argument("--heads", type=int, default=4)
    a.add_argument("--kv-heads", type=int, default=1)
    a.add_argument("--head-dim", type=int, default=256)
    a.add_argument("--repeats", type=int, default=5)
    a.add_argument("--batch", type=int, default=1, help="calls per timed sample")
    a.add_argument("queries", type=int, nargs="+")
    h = sub.add_parser("hf", help="HF transformers' model at --shapes, one pass")
    h.add_argument("--attn", choices=sorted(HF_IMPLS), required=True)
    h.add_argument("--shapes", type=parse_shapes, required=True)
    h.add_argument("--repeats", type=int, default=3)
    h.add_argument("lengths", type=int, nargs="+")
    for s in (a, h):
        s.add_argument("--backend", choices=[DEFAULT_BACKEND, *SDPA_BACKENDS],
                       default=DEFAULT_BACKEND)
        s.add_argument("--device", default="cuda")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one peer and print its records (`bench.gpu_peers`' protocol); exit 0 also when
    torch, transformers or the device is missing (a ``peer_skipped`` record says so).

    ``attention``: causal `torch.nn.functional.scaled_dot_product_attention` over QUERIES
    tokens in bf16 (`attention_cases`). ``hf``: HF transformers' causal LM of the shapes'
    family, one pass over N random tokens with no KV cache kept (`hf_cases`).

    `--backend` (``default``: torch's own pick) is one of `bench.gpu_peers.SDPA_BACKENDS`,
    enforced with `torch.nn.attention.sdpa_kernel` around every call: a backend that cannot
    take the inputs is a ``peer_error`` record. The math backend (and HF's eager attention)
    materialize every score; a length whose scores would not fit in the device's free memory
    is a ``peer_skipped`` record (`scores_fit`).
    """
    started = time.perf_counter()
    args = parser().parse_args(argv)
    label = TORCH_SDPA if args.what == "attention" else HF_IMPLS[args.attn]
    if args.what == "attention" or args.attn == "sdpa":
        rec = child_recorder(process_label(label, args.backend), args.backend)
    else:  # flex_attention and eager call no SDPA backend
        rec = child_recorder(process_label(label), args.attn)
    try:
        import torch
        if args.what == "hf":
            import transformers  # noqa: F401
    except ImportError as error:
        rec("peer_skipped", 0.0, "none", impl=label, reason=f"not importable: {error}")
    else:
        if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
            rec("peer_skipped", 0.0, "none", impl=label, reason="torch sees no CUDA device")
        elif args.what == "attention":
            attention_cases(rec, args.backend, args.queries, args.heads, args.kv_heads,
                            args.head_dim, args.repeats, args.batch, args.device)
        else:
            hf_cases(rec, args.attn, args.backend, args.shapes, args.lengths, args.repeats,
                     args.device)
    finish_child(rec, started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
