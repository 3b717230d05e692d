"""In-process prefill: timing helpers, mlx-lm's Gemma 3 on our weights, the cost curves."""

from __future__ import annotations

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


# prefillq's Gemma 3 module names (the GGUF's) -> HF's, which mlx-lm follows
HF_NAMES = {
    "attn.attn_q": "self_attn.q_proj", "attn.attn_k": "self_attn.k_proj",
    "attn.attn_v": "self_attn.v_proj", "attn.attn_output": "self_attn.o_proj",
    "attn.attn_q_norm": "self_attn.q_norm", "attn.attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "mlp.ffn_gate": "mlp.gate_proj", "mlp.ffn_up": "mlp.up_proj",
    "mlp.ffn_down": "mlp.down_proj",
}


def mlx_lm_gemma3(loaded: LoadedModel):
    """mlx-lm's `gemma3_text.Model` sharing our dequantized arrays (its norms add the +1
    that llama.cpp's GGUF already folded in, so we subtract it)."""
    from mlx_lm.models import gemma3_text

    a = loaded.model.args
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=a.hidden_size,
        num_hidden_layers=a.num_hidden_layers, intermediate_size=a.intermediate_size,
        num_attention_heads=a.num_attention_heads, head_dim=a.head_dim,
        rms_norm_eps=a.rms_norm_eps, vocab_size=a.vocab_size,
        num_key_value_heads=a.num_key_value_heads, rope_theta=a.rope_theta,
        rope_local_base_freq=a.rope_local_base_freq, query_pre_attn_scalar=a.head_dim,
        sliding_window=a.sliding_window, sliding_window_pattern=a.sliding_window_pattern,
        max_position_embeddings=a.context_length,
    )
    model = gemma3_text.Model(args)
    weights = {}
    for name, value in nn.utils.tree_flatten(loaded.model.parameters()):
        if name == "token_embd.weight":
            weights["model.embed_tokens.weight"] = value
        elif name == "output_norm.weight":
            weights["model.norm.weight"] = value - 1
        else:
            _, layer, rest = name.split(".", 2)
            module, _, param = rest.rpartition(".")
            target = f"model.layers.{layer}.{HF_NAMES[module]}.{param}"
            weights[target] = value - 1 if "norm" in module else value
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    mx.eval(model.parameters())
    return model


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
