"""Where one Gemma 3 chunk's time goes, op group by op group (MLX has no CPU profiler).

    python -m bench.profile [--chunk 2048] [--position 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx

from .common import load_or_exit, timed


def _time(fn, repeats: int) -> float:
    fn()  # warm up (allocations, BLAS threads)
    return timed(lambda: mx.eval(fn()), repeats)[0]


def profile(loaded, chunk: int, position: int, repeats: int) -> list[dict]:
    """Each group runs alone on arrays of the real shapes (a chunk of `chunk` queries at
    `position`), split over CPU streams as in the model (``PREFILLQ_CPU_STREAMS=1``: one),
    the fastest of `repeats`. Each time the runs per forward pass (``norms_6``: a layer's six
    RMS norms), summed, predicts a chunk's time; timed alone, groups cannot overlap as in the
    whole graph, so the sum exceeds a measured chunk (`main`): read the groups as shares."""
    from model.archs.gemma3 import gelu_gate
    from model.cache import window_mask
    from model.runtime.streams import split_map

    a = loaded.model.args
    blk = loaded.model.blk[0]
    attn = blk.attn
    hd, heads, kv = a.head_dim, a.num_attention_heads, a.num_key_value_heads
    x = mx.random.normal((1, chunk, a.hidden_size))
    q = mx.random.normal((1, heads, chunk, hd))
    window = a.sliding_window
    n_prev = min(position, window - 1)
    local_k = mx.random.normal((1, kv, n_prev + chunk, hd))
    global_k = mx.random.normal((1, kv, position + chunk, hd))
    h_ffn = mx.random.normal((1, chunk, a.intermediate_size))
    n_global = sum(not a.is_sliding(i) for i in range(a.num_hidden_layers))
    n_local = a.num_hidden_layers - n_global
    L = a.num_hidden_layers

    local_attn = next(b.attn for b in loaded.model.blk if b.attn.window)
    global_attn = next(b.attn for b in loaded.model.blk if not b.attn.window)
    local_mask = ("causal" if n_prev + chunk <= window
                  else window_mask(position, chunk, position - n_prev, n_prev + chunk, window))

    groups = {
        # name: (function, times per forward)
        "qkv_proj": (lambda: [attn.attn_q(x), attn.attn_k(x), attn.attn_v(x)], L),
        "o_proj": (lambda: attn.attn_output(q.transpose(0, 2, 1, 3).reshape(1, chunk, -1)), L),
        "mlp_matmuls": (lambda: [blk.mlp.ffn_gate(x), blk.mlp.ffn_up(x),
                                 blk.mlp.ffn_down(h_ffn)], L),
        "gelu_mul": (lambda: split_map(gelu_gate, [h_ffn, h_ffn], axis=1), L),
        "norms_6": (lambda: [blk.attn_norm(x), blk.post_attention_norm(x), blk.ffn_norm(x),
                             blk.post_ffw_norm(x), attn.attn_q_norm(q),
                             attn.attn_k_norm(q[:, :kv])], L),
        "rope_qk": (lambda: [mx.fast.rope(q, hd, traditional=False, base=1e4, scale=1.0,
                                          offset=position),
                             mx.fast.rope(q[:, :kv], hd, traditional=False, base=1e4,
                                          scale=1.0, offset=position)], L),
        "attention_local": (lambda: local_attn.core(q, local_k, local_k, local_mask,
                                                    position), n_local),
        "attention_global": (lambda: global_attn.core(q, global_k, global_k, "causal",
                                                      position), n_global),
        "residual_adds": (lambda: [x + x, x + x], L),
    }
    rows = []
    for name, (fn, count) in groups.items():
        seconds = _time(fn, repeats)
        rows.append({"group": name, "ms_each": round(seconds * 1e3, 2), "count": count,
                     "ms_per_chunk": round(seconds * count * 1e3, 1)})
    rows.append({"group": "sum_of_groups", "ms_per_chunk":
                 round(sum(r["ms_per_chunk"] for r in rows), 1)})
    rows.append({"group": "measured_chunk",
                 "ms_per_chunk": round(_measured_chunk(loaded, chunk, position) * 1e3, 1)})
    return rows


def _measured_chunk(loaded, chunk: int, position: int) -> float:
    """Seconds of one real `chunk`-token chunk at `position` of a prefill."""
    vocab = loaded.model.args.vocab_size
    ids = [(1000 + i) % vocab for i in range(position + chunk)]
    prefill = loaded.start_prefill(ids, chunk_tokens=chunk)
    while prefill.cursor < position:
        prefill.step()
    return timed(prefill.step)[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma3-270m", help="registry name (default %(default)s)")
    p.add_argument("--chunk", type=int, default=2048,
                   help="query rows in the chunk (default %(default)s)")
    p.add_argument("--position", type=int, default=2048,
                   help="tokens already in the KV cache (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3,
                   help="time each group as the fastest of this many runs (default %(default)s)")
    args = p.parse_args(argv)
    from model.runtime.blas import ensure_blas

    ensure_blas()
    loaded = load_or_exit(p, args.model)
    for row in profile(loaded, args.chunk, args.position, args.repeats):
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
