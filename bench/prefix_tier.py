"""python -m bench.prefix_tier [--models gemma3-tiny,gemma3-270m] [--tokens 512,2048]
                              [--repeats 3] [--json] [--out FILE]

What the prefix cache's shared tier weighs (`worker.shared_prefixes`): for a prompt prefix of
N tokens, the seconds to compute it (a cold prefill in the planner's chunks, evaluated)
against the seconds to fetch its 32-token blocks from a real redis-server as a worker does
(`SharedBlocks.fetch`: a GET and a decode a block; then `PrefixCache.add` and the restore
into an empty cache, evaluated), side by side in one process, each the median of
`--repeats`.

Records (JSON lines): ``prefix_tier_compute_us_per_token`` and
``prefix_tier_fetch_us_per_token`` (microseconds) per model and N (with a block's bytes), and
``prefix_tier_fetch_speedup``: compute over fetch (above 1: a fetch pays, as the worker's
moving averages decide it live).
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import numpy as np
import redis

from jobs.prefixes import BLOCK_TOKENS, block_keys, root_key
from model.prefix_cache import PrefixCache, prefix_prefill
from worker.checkpoints.store import RedisStore
from worker.redis_server import RedisServer
from worker.shared_prefixes import SharedBlocks

from .common import Recorder, bench_parser, log, machine_context, refuse_existing


def _ids(n: int, vocab_size: int) -> list[int]:
    return [2, *np.random.default_rng(n).integers(3, min(vocab_size, 30_000), n - 1).tolist()]


def compute_seconds(loaded, ids: list[int]) -> float:
    """A cold prefill of `ids`, every chunk evaluated."""
    t0 = time.perf_counter()
    prefill = loaded.start_prefill(ids)
    prefill.run()
    mx.eval(prefill.cache.arrays())
    return time.perf_counter() - t0


def stored_blocks(loaded, ids: list[int], shared: SharedBlocks) -> list[bytes]:
    """Prefill `ids` keeping their blocks, write them to `shared`'s store; their keys."""
    root = root_key(loaded.sha256, loaded.model.make_cache(loaded.dtype).layout())
    keys = block_keys(ids + [0], root, BLOCK_TOKENS)  # every whole block of `ids`
    cache = PrefixCache(1 << 34, BLOCK_TOKENS)
    prefill, _ = prefix_prefill(loaded.model, ids + [0], cache, keys, kv_dtype=loaded.dtype,
                                vocab_size=loaded.vocab_size,
                                context_length=loaded.context_length)
    prefill.run()
    cache.insert(keys, prefill.cache)
    shared.write(cache, keys)
    return keys


def fetch_seconds(loaded, keys: list[bytes], shared: SharedBlocks) -> tuple[float, int]:
    """Fetch `keys`' blocks, hold them and restore them into an empty cache; the seconds and
    one block's bytes."""
    t0 = time.perf_counter()
    n_layers = len(loaded.model.make_cache(loaded.dtype).layers)
    fetched, blocks = shared.fetch(keys, n_layers, BLOCK_TOKENS, None)
    cache = PrefixCache(1 << 34, BLOCK_TOKENS)
    cache.add(fetched, blocks)
    kv = loaded.model.make_cache(loaded.dtype, capacity=len(keys) * BLOCK_TOKENS)
    cache.restore(fetched, kv)
    mx.eval(kv.arrays())
    assert len(blocks) == len(keys), "every block was in the store"
    return time.perf_counter() - t0, blocks[0].nbytes


def measure(rec: Recorder, loaded, name: str, n: int, shared: SharedBlocks,
            repeats: int) -> None:
    """One model and prefix length: both sides `repeats` times, alternating."""
    ids = _ids(n, loaded.vocab_size)
    keys = stored_blocks(loaded, ids, shared)
    tokens = len(keys) * BLOCK_TOKENS
    compute_seconds(loaded, ids[:tokens])  # warm-up: MLX's kernels for these shapes
    computed, fetched, nbytes = [], [], 0
    for _ in range(repeats):
        computed.append(compute_seconds(loaded, ids[:tokens]) / tokens)
        seconds, nbytes = fetch_seconds(loaded, keys, shared)
        fetched.append(seconds / tokens)
    c, f = statistics.median(computed), statistics.median(fetched)
    common = {"model": name, "tokens": tokens, "block_bytes": nbytes}
    rec("prefix_tier_compute_us_per_token", c * 1e6, "us", **common,
        how="a cold prefill of the tokens in the planner's chunks, evaluated; median")
    rec("prefix_tier_fetch_us_per_token", f * 1e6, "us", **common,
        how="GET and decode each block from a real redis-server, hold them, restore them "
            "into an empty cache, evaluated; median")
    rec("prefix_tier_fetch_speedup", c / f, "ratio", **common,
        how="compute seconds over fetch seconds, the medians above")
    log(f"prefix tier: {name} {tokens} tokens: compute {c * 1e6:.0f} us/token, fetch "
        f"{f * 1e6:.1f} us/token ({c / f:.1f}x)")


def build_parser():
    p = bench_parser("python -m bench.prefix_tier", __doc__)
    p.add_argument("--models", default="gemma3-tiny,gemma3-270m",
                   help="registry names, comma-separated (default gemma3-tiny,gemma3-270m)")
    p.add_argument("--tokens", default="512,2048",
                   help="prefix lengths, comma-separated (default 512,2048)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of each side (default 3)")
    return p


def main(argv: list[str] | None = None) -> int:
    from model.registry import load_model

    p = build_parser()
    args = p.parse_args(argv)
    refuse_existing(p, args.out)
    models = args.models.split(",")
    lengths = [int(t) for t in args.tokens.split(",")]
    context = machine_context("prefix_tier", redis=True) | {
        "models": models, "tokens": lengths, "repeats": args.repeats,
        "device": str(mx.default_device()), "block_tokens": BLOCK_TOKENS}
    rec = Recorder(args.json, context, args.out)
    with RedisServer() as server:
        shared = SharedBlocks(RedisStore(redis.Redis.from_url(server.url)))
        for name in models:
            loaded = load_model(name)
            for n in lengths:
                measure(rec, loaded, name, n, shared, args.repeats)
    return 0


if __name__ == "__main__":
    from model.runtime.blas import ensure_blas

    ensure_blas()
    raise SystemExit(main())
