"""mlx-lm, a peer of `python -m bench.gpu`, alone in its process:

    python -m bench.gpu_peer_mlx_lm --shapes JSON [--repeats 5] N:CHUNK [N:CHUNK ...]

mlx-lm's ``gemma3_text`` at `--shapes` (`bench.gpu_peers.shapes_of`), random bf16
weights, the head tied to the embedding, prefilling N random tokens in CHUNK-token chunks
in its own cache (``make_prompt_cache``), one ``mx.eval`` of the cache per chunk as
mlx-lm's ``generate_step`` prefills, and the head on the final position only. Its
``mx.clear_cache()`` after each chunk is left out: it only hands buffers back to the
allocator, so leaving it out can only speed mlx-lm up. ``gpu_prefill_tok_s`` records,
fastest of `--repeats` after a warm-up, in `bench.gpu_peers`' protocol. prefillq's
`model` is not imported: it would set its own CUDA graph knobs for the process.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from .gpu_peers import MLX_LM, child_recorder, finish_child, measure, parse_shapes, process_label


def mlx_lm_model(shapes: dict, dtype: mx.Dtype = mx.bfloat16):
    """mlx-lm's ``gemma3_text.Model`` at `shapes`, random weights in `dtype`, the head tied
    to the embedding (``sanitize`` of a checkpoint without ``lm_head.weight``, as Gemma
    3's). Raises ImportError without mlx-lm."""
    from mlx_lm.models import gemma3_text

    a = shapes
    model = gemma3_text.Model(gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=a["hidden_size"],
        num_hidden_layers=a["num_hidden_layers"], intermediate_size=a["intermediate_size"],
        num_attention_heads=a["num_attention_heads"],
        num_key_value_heads=a["num_key_value_heads"], head_dim=a["head_dim"],
        vocab_size=a["vocab_size"], rms_norm_eps=a["rms_norm_eps"],
        rope_theta=a["rope_theta"], rope_local_base_freq=a["rope_local_base_freq"],
        query_pre_attn_scalar=a["head_dim"],  # prefillq's scale is head_dim ** -0.5
        sliding_window=a["sliding_window"], sliding_window_pattern=a["sliding_window_pattern"],
        max_position_embeddings=a["context_length"]))
    model.sanitize({})
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def mlx_lm_prefill(model, ids: mx.array, chunk: int) -> mx.array:
    """Prefill int32 ``(n,)`` `ids` through mlx-lm `model` in `chunk`-token chunks.

    Returns:
        ``(1, vocab)`` final-position logits, evaluated (the inner model's hidden states
        and the tied head on the last position only).
    """
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    n = ids.shape[0]
    for start in range(0, n, chunk):
        hidden = model.model(ids[None, start:start + chunk], cache)  # (1, L, hidden)
        if start + chunk < n:
            mx.eval([c.state for c in cache])
    logits = model.model.embed_tokens.as_linear(hidden[:, -1])
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
                impl=MLX_LM, model=shapes.get("label", "gemma3 shapes"), dtype="bfloat16",
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
    rec = child_recorder(process_label(MLX_LM), "mlx")
    try:
        import mlx_lm  # noqa: F401
    except ImportError as error:
        rec("peer_skipped", 0.0, "none", impl=MLX_LM, reason=f"not importable: {error}")
    else:
        mlx_lm_cases(rec, args.shapes, cases, args.repeats)
    finish_child(rec, started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
