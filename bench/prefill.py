"""In-process prefill: timing helpers, mlx-lm's model on our weights, the cost curves."""

from __future__ import annotations

import time

import mlx.core as mx
import mlx.nn as nn

from model.registry import LoadedModel

from .common import Recorder, log, prompt_ids, timed


def prefill_seconds(loaded: LoadedModel, ids: list[int], chunk_tokens: int | None,
                    repeats: int = 1) -> tuple[float, int]:
    """Fastest seconds of a whole prefill (plan, chunks, final logits) and its chunk count."""

    def run():
        prefill = loaded.start_prefill(ids, chunk_tokens)
        prefill.run()
        return prefill.chunks_done

    seconds, chunks = timed(run, repeats)
    mx.clear_cache()
    return seconds, chunks


def top1(loaded: LoadedModel, ids: list[int]) -> int:
    """Token id of the largest final logit of a default-chunked prefill of `ids`."""
    return int(loaded.start_prefill(ids).run().argmax())


# -- mlx-lm on the same weights ------------------------------------------------------------


# prefillq's module names (the GGUF's) -> HF's, which mlx-lm follows: what every family
# shares, then Gemma 3's four norms and the Llama family's two
_SHARED_NAMES = {
    "attn.attn_q": "self_attn.q_proj", "attn.attn_k": "self_attn.k_proj",
    "attn.attn_v": "self_attn.v_proj", "attn.attn_output": "self_attn.o_proj",
    "attn.attn_q_norm": "self_attn.q_norm", "attn.attn_k_norm": "self_attn.k_norm",
    "mlp.ffn_gate": "mlp.gate_proj", "mlp.ffn_up": "mlp.up_proj",
    "mlp.ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
}
HF_NAMES = {**_SHARED_NAMES,
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm"}
LLAMA_HF_NAMES = {**_SHARED_NAMES, "ffn_norm": "post_attention_layernorm"}


def their_name(family: str, name: str) -> str:
    """HF's (and mlx-lm's) name for prefillq's parameter `name` of a `family` model."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    _, layer, rest = name.split(".", 2)
    module, _, param = rest.rpartition(".")
    names = HF_NAMES if family == "gemma3" else LLAMA_HF_NAMES
    return f"model.layers.{layer}.{names[module]}.{param}"


def mlx_lm_twin(loaded: LoadedModel, rope_scaling: dict | None = None):
    """mlx-lm's own model of `loaded`'s family (``gemma3_text``, ``llama``, ``qwen2``,
    ``qwen3``) sharing our dequantized arrays: the same function, mlx-lm's code. Gemma 3's
    norms add the +1 that llama.cpp's GGUF already folded in, so we subtract it; a
    ``llama`` GGUF's q/k rows are in the interleaved order llama.cpp's converter wrote,
    which mlx-lm rotates with ``rope_traditional``.

    Args:
        rope_scaling: HF's ``rope_scaling`` (e.g. Llama 3's) for mlx-lm to derive its own
            frequencies from: a GGUF keeps only the divisors (``rope_freqs``). Linear
            scaling (``rope_scale``, Gemma 3 4B and larger) needs none: it is passed on.

    Raises:
        ValueError: `loaded` scales its RoPE by ``rope_freqs`` and no `rope_scaling` is
            given.
        KeyError: mlx-lm has no model for the family.
    """
    from .gpu_peer_mlx_lm import mlx_lm_args, mlx_lm_module
    from .gpu_peers import shapes_of

    args = loaded.model.args
    family = getattr(args, "architecture", "gemma3")
    if rope_scaling is None and getattr(args, "rope_freqs", False):
        raise ValueError(f"{loaded.name} scales its RoPE by rope_freqs: give mlx-lm its "
                         "rope_scaling")
    their_args = mlx_lm_args(shapes_of(args, loaded.name, rope_scaling=rope_scaling))
    model = mlx_lm_module(their_args.model_type).Model(their_args)
    weights = {}
    for name, value in nn.utils.tree_flatten(loaded.model.parameters()):
        shifted = family == "gemma3" and "norm" in name
        weights[their_name(family, name)] = value - 1 if shifted else value
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    mx.eval(model.parameters())
    return model


def attention_share(rec: Recorder, loaded: LoadedModel, chunk: int = 2048,
                    repeats: int = 3) -> None:
    """Record the share of a ``2 x chunk``-token prefill's time that attention takes,
    from the two chunks' times alone: both run the same linear work L, and causal attention
    costs the first chunk A (``chunk^2 / 2`` query-key pairs) and the second 3A (``chunk``
    more keys each), so ``A = (t2 - t1) / 2`` and the share is ``4A / (t1 + t2)``. Exact
    for global layers; windowed layers attend less, so for them it is a bound. Each chunk's
    time is the fastest of `repeats` prefills."""
    ids = prompt_ids(2 * chunk, loaded.name)

    def chunk_seconds() -> list[float]:
        prefill = loaded.start_prefill(ids, chunk)
        out = []
        while not prefill.done:
            t0 = time.perf_counter()
            prefill.step()
            out.append(time.perf_counter() - t0)
        mx.clear_cache()
        return out

    chunk_seconds()  # warm up
    t1, t2 = (min(ts) for ts in zip(*(chunk_seconds() for _ in range(repeats)), strict=True))
    attention = (t2 - t1) / 2
    rec("attention_share", 4 * attention / (t1 + t2), "fraction", model=loaded.name,
        n_tokens=2 * chunk, chunk_tokens=chunk, first_chunk_s=round(t1, 5),
        second_chunk_s=round(t2, 5), linear_s_per_chunk=round(t1 - attention, 5),
        repeats=repeats)


def curves(rec: Recorder, loaded: LoadedModel, lengths: list[int], chunk_sizes: list[int],
           chunk_curve_n: int) -> None:
    for n in lengths:
        log(f"tokens/s vs prompt length: {n}")
        seconds, chunks = prefill_seconds(loaded, prompt_ids(n), None)
        rec("tok_s_vs_prompt_length", n / seconds, "tok/s", n_tokens=n, chunks=chunks)
    ids = prompt_ids(chunk_curve_n)
    for size in chunk_sizes:
        log(f"tokens/s vs chunk size: {size}")
        seconds, chunks = prefill_seconds(loaded, ids, size)
        rec("tok_s_vs_chunk_size", chunk_curve_n / seconds, "tok/s", chunk_tokens=size,
            n_tokens=chunk_curve_n, chunks=chunks)
