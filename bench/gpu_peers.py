"""Other implementations of the same prefill, measured by `python -m bench.gpu` in its run.

Each peer builds Gemma 3 at prefillq's shapes (`bench.gpu.GEMMA3_270M`, or `args`), random
weights, bf16, and returns only the final position's logits through the tied head:

- mlx-lm's ``gemma3_text``: the same chunks as prefillq, in mlx-lm's own cache
  (``make_prompt_cache``), with one ``mx.eval`` of the cache per chunk, as mlx-lm's
  ``generate_step`` prefills. Its ``mx.clear_cache()`` after each chunk is left out: it only
  hands buffers back to the allocator, so leaving it out can only speed mlx-lm up.
- HF transformers ``Gemma3ForCausalLM`` with ``sdpa`` and ``flex_attention``: one pass over
  the whole prompt (its natural prefill: no chunking), ``logits_to_keep=1``, under
  ``torch.inference_mode()``.

A peer that is not importable is skipped with a log line; one that fails (a 32K ``sdpa``
pass out of memory) gets a ``gpu_prefill_error`` record and the run goes on. Records are
``gpu_prefill_tok_s`` with ``impl``, the peer's versions, ``n_tokens`` and ``chunk_tokens``
(the whole prompt for a one-pass peer); `ratios` puts prefillq's speed over them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

import mlx.core as mx

from model.archs import gemma3

from .common import Recorder, log

MLX_LM = "mlx-lm gemma3_text"
HF_IMPLS = {"sdpa": "transformers sdpa", "flex_attention": "transformers flex_attention"}
HF_FLEX = HF_IMPLS["flex_attention"]
# One pass of 32K tokens takes ~0.1-0.4 s on an H200, and torch's timings vary less than
# MLX's host-side graph building, so 3 runs after the warm-up one.
HF_REPEATS = 3
# Characters of a failed peer's error kept on its record (an OOM message runs long).
ERROR_CHARS = 400

# (impl, n_tokens, chunk_tokens) -> tokens/s
Peers = dict[tuple[str, int, int], float]


def _shapes(args: gemma3.ModelArgs | None) -> gemma3.ModelArgs:
    if args is not None:
        return args
    from .gpu import GEMMA3_270M  # bench.gpu imports this module

    return GEMMA3_270M


def _label(args: gemma3.ModelArgs | None) -> str:
    return "gemma3-270m shapes" if args is None else f"gemma3 shapes ({args.hidden_size} wide)"


def mlx_lm_model(args: gemma3.ModelArgs | None = None, dtype: mx.Dtype = mx.bfloat16):
    """mlx-lm's ``gemma3_text.Model`` at `args`' shapes (default `bench.gpu.GEMMA3_270M`),
    random weights in `dtype`, the head tied to the embedding (``sanitize`` of a checkpoint
    without ``lm_head.weight``, as Gemma 3's). Raises ImportError without mlx-lm."""
    from mlx_lm.models import gemma3_text

    a = _shapes(args)
    model = gemma3_text.Model(gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=a.hidden_size,
        num_hidden_layers=a.num_hidden_layers, intermediate_size=a.intermediate_size,
        num_attention_heads=a.num_attention_heads, num_key_value_heads=a.num_key_value_heads,
        head_dim=a.head_dim, vocab_size=a.vocab_size, rms_norm_eps=a.rms_norm_eps,
        rope_theta=a.rope_theta, rope_local_base_freq=a.rope_local_base_freq,
        query_pre_attn_scalar=a.head_dim,  # prefillq's scale is head_dim ** -0.5
        sliding_window=a.sliding_window, sliding_window_pattern=a.sliding_window_pattern,
        max_position_embeddings=a.context_length))
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


def mlx_lm_prefill_seconds(n: int, chunk: int, repeats: int,
                           args: gemma3.ModelArgs | None = None, model=None) -> float:
    """Fastest wall seconds of `repeats` mlx-lm prefills of `n` random tokens in `chunk`-token
    chunks, after a warm-up one; `model` defaults to `mlx_lm_model(args)`."""
    model = model if model is not None else mlx_lm_model(args)

    def once() -> float:
        ids = mx.random.randint(0, model.args.vocab_size, (n,))
        mx.eval(ids)
        t0 = time.perf_counter()
        mlx_lm_prefill(model, ids, chunk)
        return time.perf_counter() - t0

    once()
    return min(once() for _ in range(repeats))


def hf_config(args: gemma3.ModelArgs | None = None):
    """``transformers.Gemma3TextConfig`` at `args`' shapes (default `bench.gpu.GEMMA3_270M`):
    every `sliding_window_pattern`-th layer global, RoPE bases as prefillq's, the head tied."""
    from transformers import Gemma3TextConfig

    a = _shapes(args)
    return Gemma3TextConfig(
        vocab_size=a.vocab_size, hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size, num_hidden_layers=a.num_hidden_layers,
        num_attention_heads=a.num_attention_heads, num_key_value_heads=a.num_key_value_heads,
        head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps, sliding_window=a.sliding_window,
        query_pre_attn_scalar=a.head_dim, max_position_embeddings=a.context_length,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        layer_types=["sliding_attention" if a.is_sliding(i) else "full_attention"
                     for i in range(a.num_hidden_layers)],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": a.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": a.rope_local_base_freq}})


def hf_model(attn_implementation: str, args: gemma3.ModelArgs | None = None,
             device: str = "cuda", dtype=None):
    """``Gemma3ForCausalLM`` from `hf_config(args)`, random init, on `device`, in `dtype`
    (default ``torch.bfloat16``), in eval mode. Raises ImportError without torch or
    transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            hf_config(args), attn_implementation=attn_implementation,
            dtype=dtype or torch.bfloat16)
    return model.to(device).eval()


def hf_prefill(model, ids):
    """One pass of int64 ``(1, n)`` `ids` (a torch tensor on the model's device) through HF
    `model`, filling its cache; returns the ``(1, vocab)`` final-position logits."""
    import torch

    with torch.inference_mode():
        return model(input_ids=ids, use_cache=True, logits_to_keep=1).logits[:, -1]


def _synchronize(device: str) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def hf_prefill_seconds(n: int, attn_implementation: str, repeats: int = HF_REPEATS,
                       args: gemma3.ModelArgs | None = None, device: str = "cuda",
                       model=None) -> float:
    """Fastest wall seconds of `repeats` one-pass HF prefills of `n` random tokens, after a
    warm-up one (which also compiles ``flex_attention``), the device synchronized around
    each; `model` defaults to `hf_model(attn_implementation, args, device)`."""
    import torch

    model = model if model is not None else hf_model(attn_implementation, args, device)
    vocab = model.config.vocab_size

    def once() -> float:
        ids = torch.randint(0, vocab, (1, n), device=device)
        _synchronize(device)
        t0 = time.perf_counter()
        hf_prefill(model, ids)
        _synchronize(device)
        return time.perf_counter() - t0

    once()
    return min(once() for _ in range(repeats))


def measure_peer(rec: Recorder, impl: str, n: int, chunk: int, seconds: Callable[[], float],
                 label: str = "gemma3-270m shapes", **versions) -> Peers:
    """Record one peer's case: ``gpu_prefill_tok_s`` from ``seconds()`` (wall seconds of the
    whole prefill), or ``gpu_prefill_error`` (value 0) with the error if it raised.
    Returns ``{(impl, n, chunk): tokens/s}``, or ``{}`` after an error."""
    try:
        s = seconds()
    except Exception as error:  # a peer's failure (32K sdpa out of memory) must not end the run
        rec("gpu_prefill_error", 0.0, "none", impl=impl, model=label, n_tokens=n,
            chunk_tokens=chunk, error=f"{type(error).__name__}: {error}"[:ERROR_CHARS],
            **versions)
        return {}
    rec("gpu_prefill_tok_s", n / s, "tok/s", impl=impl, model=label, dtype="bfloat16",
        n_tokens=n, chunk_tokens=chunk, seconds=round(s, 5), **versions)
    return {(impl, n, chunk): n / s}


def mlx_lm_cases(rec: Recorder, cases: Iterable[tuple[int, int]], repeats: int,
                 args: gemma3.ModelArgs | None = None) -> Peers:
    """mlx-lm at each ``(n_tokens, chunk_tokens)`` of `cases`; ``{}`` and a log line when
    mlx-lm is not importable."""
    try:
        import mlx_lm
    except ImportError as error:
        log(f"mlx-lm is not importable ({error}): its runs are skipped")
        return {}
    peers: Peers = {}
    model = mlx_lm_model(args)
    for n, chunk in cases:
        log(f"{MLX_LM}, {n} tokens in {chunk}-token chunks")
        peers |= measure_peer(
            rec, MLX_LM, n, chunk, lambda n=n, c=chunk, m=model: mlx_lm_prefill_seconds(
                n, c, repeats, model=m), _label(args),
            mlx_lm=mlx_lm.__version__, mlx=mx.__version__)
    del model
    mx.clear_cache()
    return peers


def hf_cases(rec: Recorder, lengths: Iterable[int], repeats: int = HF_REPEATS,
             args: gemma3.ModelArgs | None = None, device: str = "cuda") -> Peers:
    """HF transformers, ``sdpa`` then ``flex_attention``, one pass of each of `lengths`
    tokens; ``{}`` and a log line without torch, transformers or the device."""
    try:
        import torch
        import transformers
    except ImportError as error:
        log(f"torch or transformers is not importable ({error}): their runs are skipped")
        return {}
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        log("torch sees no CUDA device: the transformers runs are skipped")
        return {}
    peers: Peers = {}
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    for attn, impl in HF_IMPLS.items():
        for n in lengths:
            log(f"{impl}, {n} tokens in one pass")
            peers |= measure_peer(
                rec, impl, n, n, lambda n=n, a=attn: hf_prefill_seconds(
                    n, a, repeats, args, device), _label(args), **versions)
            gc.collect()  # a failed pass's tensors, before the allocator's cache is emptied
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
    return peers


def measure(rec: Recorder, cases: Iterable[tuple[int, int]], repeats: int,
            hf_repeats: int = HF_REPEATS) -> Peers:
    """Every peer at `cases` (``(n_tokens, chunk_tokens)``, `bench.gpu.GEMMA3_270M`
    shapes): mlx-lm at each case, HF once per prompt length."""
    cases = list(cases)
    peers = mlx_lm_cases(rec, cases, repeats)
    return peers | hf_cases(rec, sorted({n for n, _ in cases}), hf_repeats)


def ratios(tok_s: float, n: int, chunk: int, peers: Peers) -> dict[str, float]:
    """prefillq's `tok_s` at `n` tokens in `chunk`-token chunks over each peer measured:
    ``over_mlx_lm`` (mlx-lm at the same prompt and chunk) and ``over_hf_flex`` (HF
    flex_attention's one pass of the same prompt). A peer not in `peers` is left out."""
    out = {}
    for name, key in (("over_mlx_lm", (MLX_LM, n, chunk)), ("over_hf_flex", (HF_FLEX, n, n))):
        if key in peers:
            out[name] = round(tok_s / peers[key], 4)
    return out


# MLX's own CUDA graph knobs (mlx/backend/cuda, v0.32). Importing `model` sets prefillq's
# (`model.runtime.cuda_graphs`) process-wide, and MLX reads them once, so the peers run in a
# child process with these: each side is measured as it ships.
MLX_GRAPH_DEFAULTS = {"MLX_MAX_OPS_PER_BUFFER": "20", "MLX_CUDA_GRAPH_CACHE_SIZE": "100"}


def measure_in_child(rec: Recorder, cases: Iterable[tuple[int, int]], repeats: int) -> Peers:
    """`measure` in ``python -m bench.gpu_peers`` under `MLX_GRAPH_DEFAULTS`; its records
    are recorded here (with ``mlx_env``) and its peers returned. A child that fails leaves a
    ``gpu_prefill_error`` record and no peers."""
    argv = [sys.executable, "-m", "bench.gpu_peers", "--repeats", str(repeats),
            *[f"{n}:{chunk}" for n, chunk in cases]]
    env = {**os.environ, **MLX_GRAPH_DEFAULTS}
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    sys.stderr.write(done.stderr)
    peers: Peers = {}
    for line in done.stdout.splitlines():
        if not line.startswith("{"):
            continue  # a library's own print
        record = json.loads(line)
        record.pop("holds", None)
        rec(record.pop("metric"), record.pop("value"), record.pop("unit"),
            mlx_env=MLX_GRAPH_DEFAULTS, **record)
        if record.get("impl") and rec.records[-1]["metric"] == "gpu_prefill_tok_s":
            peers[(record["impl"], record["n_tokens"], record["chunk_tokens"])] = \
                rec.records[-1]["value"]
    if done.returncode:
        rec("gpu_prefill_error", 0.0, "none", impl="peers (child process)",
            error=done.stderr[-ERROR_CHARS:])
    return peers


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.gpu_peers [--repeats R] N:CHUNK ...``: `measure` at those cases,
    one JSON record a line on stdout (what `measure_in_child` reads)."""
    p = argparse.ArgumentParser(prog="python -m bench.gpu_peers")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("cases", nargs="+", help="N:CHUNK, e.g. 8192:2048")
    args = p.parse_args(argv)
    cases = [tuple(int(v) for v in case.split(":")) for case in args.cases]
    measure(Recorder(True, {}), cases, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
