"""python -m bench.serve_peer_hf --shapes JSON [--jobs 1000] [--batch 64] [--seed 0]
    [--attn sdpa] [--backend default] [--repeats 2] [--device cuda] [--json] [--out FILE]

`bench.serve`'s scoring workload through HF transformers in padded batches: its peer for
issue 26's served bound on a GPU (prefillq's default worker at least 1.0x this). The same
prompts as ``bench.serve --seed S --jobs N`` for a model of the shapes' vocabulary (BOS,
then random ids, 32-512 tokens each), in batches of `--batch`, each batch left-padded to its
longest prompt with an attention mask and position ids that start at each prompt's first
token, one forward pass a batch with the head on the last position only
(``logits_to_keep=1``), the top-1 id of every prompt taken on the device, as a scoring
harness does. Random weights at the shapes (`bench.gpu_peer_torch.hf_model`), bf16.
`--attn` picks HF's attention implementation (``sdpa``, ``flex_attention``, ``eager``), and
`--backend` the one SDPA backend ``sdpa`` may use (`bench.gpu_peers.SDPA_BACKENDS`;
``default`` leaves the choice to torch), so that each can be timed in a process of its own
and the fastest taken as the peer.

Two orders: ``submit`` (the prompts as submitted) and ``length`` (longest first, as
lm-eval's HF backend sorts its requests so that a batch pads little). Each order runs the
whole workload once to warm up, then `--repeats` times; a ``serve_peer_jobs_per_s`` record
per order, the fastest run, with tokens/s and the share of padding. Run it in a process of
its own: MLX is never imported here (torch picks a slower attention backend in a process
where MLX has used the GPU; docs/benchmarks.md).
"""

from __future__ import annotations

import time

from .common import Recorder, bench_parser, log, machine_context, refuse_existing
from .gpu_peer_torch import backend_context, hf_model
from .gpu_peers import DEFAULT_BACKEND, SDPA_BACKENDS, parse_shapes
from .serve import plan_prompts

ORDERS = ("submit", "length")


def batches(prompts: list[list[int]], batch: int, order: str) -> list[list[list[int]]]:
    """`prompts` in batches of `batch`: as given (``submit``) or longest first
    (``length``)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, not {order!r}")
    ordered = sorted(prompts, key=len, reverse=True) if order == "length" else prompts
    return [ordered[i : i + batch] for i in range(0, len(ordered), batch)]


def left_padded(batch: list[list[int]], pad: int = 0):
    """A batch as int64 torch tensors ``(B, longest)``: ids left-padded with `pad`, the
    attention mask (1 on real tokens), and position ids counting from each prompt's first
    real token (0 on padding)."""
    import torch

    longest = max(map(len, batch))
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in batch])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def score_all(model, groups: list[list[list[int]]], device: str) -> list[int]:
    """Every prompt's top-1 next-token id, batch by batch, one forward pass each; waits
    for the device at the end."""
    import torch

    tops = []
    with torch.inference_mode():
        for group in groups:
            ids, mask, positions = (t.to(device) for t in left_padded(group))
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                           use_cache=False, logits_to_keep=1).logits[:, -1]
            tops.append(logits.argmax(-1))
        return torch.cat(tops).tolist()  # .tolist() waits for the device


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("python -m bench.serve_peer_hf", __doc__)
    p.add_argument("--shapes", type=parse_shapes, required=True,
                   help="the model's shapes (bench.gpu_peers.shapes_of), as JSON")
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attn", default="sdpa", help="HF attn_implementation (default sdpa)")
    p.add_argument("--backend", default=DEFAULT_BACKEND, choices=[DEFAULT_BACKEND, *SDPA_BACKENDS],
                   help="the only SDPA backend torch may use (default: torch's own pick)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    refuse_existing(p, args.out)
    import torch
    import transformers

    shapes = args.shapes
    prompts = plan_prompts(args.jobs, shapes.get("label", ""), shapes["vocab_size"], args.seed)
    tokens = sum(map(len, prompts))
    rec = Recorder(args.json, machine_context("serve_peer_hf") | {
        "jobs": args.jobs, "batch": args.batch, "seed": args.seed, "attn": args.attn,
        "sdpa_backend": args.backend,
        "tokens": tokens, "torch": torch.__version__, "transformers": transformers.__version__,
        "model": shapes.get("label"), "dtype": "bfloat16"}, args.out)
    model = hf_model(args.attn, shapes, args.device)
    with backend_context(args.backend):
        run_orders(rec, model, prompts, args)
    return 0


def run_orders(rec: Recorder, model, prompts: list[list[int]], args) -> None:
    """Time `model` scoring `prompts` in each of `ORDERS` (a warm-up pass, then the fastest
    of ``args.repeats``); a ``serve_peer_jobs_per_s`` record each."""
    tokens = sum(map(len, prompts))
    for order in ORDERS:
        groups = batches(prompts, args.batch, order)
        padded = sum(len(g) * max(map(len, g)) for g in groups)
        score_all(model, groups, args.device)  # warm-up: kernels, autotuning, allocator
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            score_all(model, groups, args.device)
            best = min(best, time.perf_counter() - t0)
        log(f"serve_peer_hf: {order} order, {len(groups)} batches, {best:.2f} s")
        rec("serve_peer_jobs_per_s", args.jobs / best, "jobs/s", order=order,
            tokens_per_s=round(tokens / best), wall_s=round(best, 3), batches=len(groups),
            padding_share=round(1 - tokens / padded, 4), repeats=args.repeats,
            how="fastest of the repeats after a warm-up pass of the whole workload")


if __name__ == "__main__":
    raise SystemExit(main())
