"""`bench.gpu_deepseek4.check_gathered_layers` on the CPU at tiny shapes: there the product's
path gathers the indexer's top-k rows in MLX ops (`gathered_attention`), and the check
compares it, chunk by chunk, with the masked dense form; a wrong key list fails it."""

from __future__ import annotations

import mlx.core as mx

from bench import gpu_deepseek4
from bench.common import Recorder
from model.archs.deepseek4 import flash_args
from model.archs.deepseek4 import model as ds_model
from model.archs.deepseek4 import moe as ds_moe

TINY = flash_args(hidden_size=64, num_attention_heads=4, head_dim=32, rope_dim=8,
                  q_lora_rank=32, o_lora_rank=16, o_groups=2, sliding_window=8,
                  index_n_heads=2, index_head_dim=16, index_topk=4, n_routed_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32, vocab_size=100,
                  compress_ratios=(0, 0, 4, 128))


def test_the_layer_check_passes_where_gathering_is_exact():
    rec = Recorder(False, {})
    assert gpu_deepseek4.check_gathered_layers(rec, n=512, chunk=128, args=TINY,
                                               dtype=mx.float32)
    assert {r["ratio"] for r in rec.records} == {0, 4, 128}
    assert len(rec.records) == 12 and all(r["holds"] for r in rec.records)


def test_the_layer_check_fails_on_a_wrong_key_list(monkeypatch):
    real = ds_model.window_slots

    def off_by_one(L, n_prev, window):  # every query's window one row late
        slots = real(L, n_prev, window)
        return mx.where(slots >= 0, mx.maximum(slots - 1, 0), -1)

    monkeypatch.setattr(ds_model, "window_slots", off_by_one)
    rec = Recorder(False, {})
    assert not gpu_deepseek4.check_gathered_layers(rec, n=512, chunk=128, args=TINY,
                                                   dtype=mx.float32)
    failed = {r["ratio"] for r in rec.records if not r["holds"]}
    assert failed == {4}  # the only layer kind that gathers on the CPU


def test_the_experts_check_passes_where_both_paths_are_exact():
    """`check_padded_experts` at tiny widths on the CPU (float32: MLX's CPU gather_mm takes
    nothing else); both paths hold."""
    args = flash_args(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8)
    rec = Recorder(False, {})
    assert gpu_deepseek4.check_padded_experts(rec, L=64, args=args, dtype=mx.float32)
    assert [r["path"] for r in rec.records] == ["padded", "gathered"]
    assert all(r["holds"] for r in rec.records)


def test_the_experts_check_fails_when_a_path_is_wrong(monkeypatch):
    real = ds_moe.MoE._padded

    def reversed_tokens(self, x, inds, weights):  # every token gets the last one's experts
        return real(self, x, inds[::-1], weights)

    monkeypatch.setattr(ds_moe.MoE, "_padded", reversed_tokens)
    rec = Recorder(False, {})
    args = flash_args(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8)
    assert not gpu_deepseek4.check_padded_experts(rec, L=64, args=args, dtype=mx.float32)
    assert [r["holds"] for r in rec.records] == [False, True]


def test_the_ablation_runs_every_variant_and_restores_what_it_swaps():
    from model.archs.deepseek4 import layers as ds_layers

    swapped = (ds_moe.expert_path, ds_layers.angle_table)
    rec = Recorder(False, {})
    gpu_deepseek4.ablate(rec, n=256, chunk=64, repeats=1, args=TINY, dtype=mx.float32)
    assert [r["variant"] for r in rec.records] == list(gpu_deepseek4.ABLATIONS)
    assert rec.records[0]["over_baseline"] == 1.0
    assert all(r["value"] > 0 for r in rec.records)
    assert (ds_moe.expert_path, ds_layers.angle_table) == swapped
