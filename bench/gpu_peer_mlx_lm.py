"""mlx-lm, a peer of `python -m bench.gpu`, alone in its process:

    python -m bench.gpu_peer_mlx_lm --shapes JSON [--repeats 5] N:CHUNK [N:CHUNK ...]

prefillq's `model` is not imported: it would set its own CUDA graph knobs for the process.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from .gpu_peers import (
    child_recorder,
    finish_child,
    measure,
    mlx_lm_impl,
    parse_shapes,
    process_label,
    rope_scaling,
)


def mlx_lm_args(shapes: dict):
    """mlx-lm's ``ModelArgs`` for `shapes` (`bench.gpu_peers.shapes_of`), by ``family``:
    ``gemma3_text`` (its windowed layers as prefillq's), ``llama`` (``rope_scaling`` as
    the shapes give it, in HF's form), ``qwen2`` or ``qwen3``. Raises KeyError for another
    family."""
    from mlx_lm.models import gemma3_text, llama, qwen2, qwen3

    a, family = shapes, shapes.get("family", "gemma3")
    common = dict(hidden_size=a["hidden_size"], num_hidden_layers=a["num_hidden_layers"],
                  intermediate_size=a["intermediate_size"],
                  num_attention_heads=a["num_attention_heads"],
                  num_key_value_heads=a["num_key_value_heads"], head_dim=a["head_dim"],
                  vocab_size=a["vocab_size"], rms_norm_eps=a["rms_norm_eps"],
                  rope_theta=a["rope_theta"], max_position_embeddings=a["context_length"])
    if family == "gemma3":  # mlx-lm scales only its global layers' RoPE, as prefillq
        return gemma3_text.ModelArgs(
            model_type="gemma3_text", **common,
            rope_local_base_freq=a["rope_local_base_freq"],
            query_pre_attn_scalar=a.get("query_pre_attn_scalar") or a["head_dim"],
            rope_scaling=rope_scaling(a),
            sliding_window=a["sliding_window"],
            sliding_window_pattern=a["sliding_window_pattern"])
    if family == "llama":
        return llama.ModelArgs(model_type="llama", **common,
                               rope_traditional=a["rope_traditional"],
                               rope_scaling=rope_scaling(a),
                               tie_word_embeddings=a["tie_word_embeddings"])
    if family == "qwen2":  # its head dim is width / heads
        del common["head_dim"]
        return qwen2.ModelArgs(model_type="qwen2", **common,
                               tie_word_embeddings=a["tie_word_embeddings"])
    if family == "qwen3":
        return qwen3.ModelArgs(model_type="qwen3", **common,
                               tie_word_embeddings=a["tie_word_embeddings"])
    raise KeyError(f"no mlx-lm model for family {family!r}")


def mlx_lm_module(model_type: str):
    """The ``mlx_lm.models`` module of `model_type` (e.g. ``llama``)."""
    import importlib

    return importlib.import_module(f"mlx_lm.models.{model_type}")


def mlx_lm_model(shapes: dict, dtype: mx.Dtype = mx.bfloat16):
    """mlx-lm's model for `shapes` (`mlx_lm_args`), random weights in `dtype`, the head
    tied to the embedding where the shapes say (``sanitize`` of a checkpoint without
    ``lm_head.weight``, as Gemma 3's). Raises ImportError without mlx-lm."""
    args = mlx_lm_args(shapes)
    model = mlx_lm_module(args.model_type).Model(args)
    model.sanitize({})
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def mlx_lm_prefill(model, ids: mx.array, chunk: int) -> mx.array:
    """Prefill int32 ``(n,)`` `ids` through mlx-lm `model` in `chunk`-token chunks.

    Returns:
        ``(1, vocab)`` final-position logits, evaluated (the inner model's hidden states
        and the head, tied or not, on the last position only).

    One ``mx.eval`` of the cache per chunk, as mlx-lm's ``generate_step`` prefills. Its
    ``mx.clear_cache()`` after each chunk is left out: it only hands buffers back to the
    allocator, so leaving it out can only speed mlx-lm up.
    """
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    n = ids.shape[0]
    for start in range(0, n, chunk):
        hidden = model.model(ids[None, start:start + chunk], cache)  # (1, L, hidden)
        if start + chunk < n:
            mx.eval([c.state for c in cache])
    head = getattr(model, "lm_head", None) or model.model.embed_tokens.as_linear
    logits = head(hidden[:, -1])
    mx.eval(logits, [c.state for c in cache])
    return logits


def mlx_lm_prefill_seconds(model, n: int, chunk: int, repeats: int) -> float:
    """Fastest wall seconds of `repeats` prefills of `n` random tokens in `chunk`-token
    chunks through `model`, after a warm-up one."""
    def once() -> float:
        ids = mx.random.randint(0, model.args.vocab_size, (n,))
        mx.eval(ids)
        t0 = time.perf_counter()
        mlx_lm_prefill(model, ids, chunk)
        return time.perf_counter() - t0

    once()
    return min(once() for _ in range(repeats))


def mlx_lm_cases(rec, shapes: dict, cases, repeats: int) -> None:
    """mlx-lm at each ``(n_tokens, chunk_tokens)`` of `cases`, at `shapes`."""
    import mlx_lm

    model = mlx_lm_model(shapes)
    for n, chunk in cases:
        measure(rec, "gpu_prefill_tok_s", "tok/s", n,
                lambda n=n, c=chunk: mlx_lm_prefill_seconds(model, n, c, repeats),
                impl=mlx_lm_impl(shapes.get("family", "gemma3")),
                model=shapes.get("label", "gemma3 shapes"), dtype="bfloat16",
                n_tokens=n, chunk_tokens=chunk, mlx_lm=mlx_lm.__version__,
                mlx=mx.__version__, device=str(mx.default_device()))


def main(argv: list[str] | None = None) -> int:
    """Run mlx-lm's cases and print their records; exit 0 also without mlx-lm (a
    ``peer_skipped`` record says so)."""
    started = time.perf_counter()
    p = argparse.ArgumentParser(prog="python -m bench.gpu_peer_mlx_lm")
    p.add_argument("--shapes", type=parse_shapes, required=True)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("cases", nargs="+", help="N:CHUNK, e.g. 8192:2048")
    args = p.parse_args(argv)
    cases = [tuple(int(v) for v in case.split(":")) for case in args.cases]
    impl = mlx_lm_impl(args.shapes.get("family", "gemma3"))
    rec = child_recorder(process_label(impl), "mlx")
    try:
        import mlx_lm  # noqa: F401
    except ImportError as error:
        rec("peer_skipped", 0.0, "none", impl=impl, reason=f"not importable: {error}")
    else:
        mlx_lm_cases(rec, args.shapes, cases, args.repeats)
    finish_child(rec, started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
