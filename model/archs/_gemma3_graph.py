"""Gemma 3's chunk forward as two compiled graphs per layer (`_pre`, `_post`), for GPUs.

The compiled calls save the host the building and launching of each layer's many small MLX
ops (docs/benchmarks.md, "Where a GPU chunk's time goes"). The equations are
`model.archs.gemma3`'s exactly; `tests/model/test_gemma3_graph.py` checks the two agree.
`GraphForward.packed` runs several jobs' chunks in one pass the same way (`_pre_packed`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from functools import partial

import mlx.core as mx
import numpy as np

from ..kernels.flash_attention import PackedJob, fresh_jobs
from ..kernels.gelu import gelu_gate
from ._packed import job_outputs

Attend = Callable[..., mx.array]

# A packed step's rows are rounded up (`padded_rows`) so that steps repeat a few shapes: a
# compiled graph is traced again, and MLX's CUDA backend builds new CUDA graphs and picks new
# matmul kernels, for every row count it has not seen, which a worker serving prompts of
# hundreds of lengths meets at almost every step (docs/benchmarks.md, "Gemma 3 270M's shapes
# served on the H200"). Powers of two up to ROW_BUCKET, then its multiples: at most 35 shapes
# up to 8,192 rows, at most ROW_BUCKET - 1 padding rows a step.
MIN_PADDED_ROWS = 32
ROW_BUCKET = 256
# Values of a layer's gated product (rows x intermediate) from which the `gate` kernel runs
# between two compiled halves instead of inside one compiled `_post`: it saves ~30 us at
# this size on an H100 (112 -> 48 us at 21M values, `model.kernels.gelu`), more than the
# host's second compiled call a layer costs where a step is host-bound (Gemma 3 270M's short
# chunks, ~10-20 us; docs/benchmarks.md).
GATE_KERNEL_MIN = 1 << 23
# Values of a chunk's q/k/v projection (rows x width) from which the `heads` kernel splits,
# norms and rotates them after a compiled `_qkv` instead of inside the compiled `_pre`: at
# Gemma 3 270M's 2,048-token chunks (3.1M) a host-bound step keeps one compiled call.
HEADS_KERNEL_MIN = 1 << 22
# A packed step's later chunks (position > 0) join the step's one attention launch a layer
# (`attend_packed`) when their keys and values there take at most this many bytes (global
# layers: every row the cache holds): the launch reads each job's keys from one array, so
# joining copies them, ~4 us at 8 MiB of an H200's ~4.8 TB/s (read and written), where a
# launch of its own costs ~15-20 us of the host's time; a job with a longer context attends
# on its own, where its attention's work dwarfs a launch and the kernel may split its keys.
# On an H100, 64 prompts of 32-512 tokens in 128-token chunks, 8 a step: 1.25-1.30x the
# packed steps' tokens/s of later chunks on their own (docs/benchmarks.md).
# ``$PREFILLQ_SHARED_KV_BYTES`` overrides it (`shared_kv_bytes`; 0: on their own).
SHARED_KV_BYTES = 8 << 20
SHARED_KV_BYTES_ENV = "PREFILLQ_SHARED_KV_BYTES"


def shared_kv_bytes() -> int:
    """``$PREFILLQ_SHARED_KV_BYTES`` (an integer >= 0) where set, else `SHARED_KV_BYTES`.

    Raises:
        ValueError: the variable is set to anything else.
    """
    value = os.environ.get(SHARED_KV_BYTES_ENV, str(SHARED_KV_BYTES))
    if not value.isdigit():
        raise ValueError(f"{SHARED_KV_BYTES_ENV} must be an integer >= 0, got {value!r}")
    return int(value)


def _joined(rows: list[mx.array]) -> mx.array:
    """`rows` ``(1, heads, n_i, head_dim)`` concatenated along the rows (one: not copied)."""
    return rows[0] if len(rows) == 1 else mx.concatenate(rows, axis=2)


def padded_rows(rows: int) -> int:
    """The rows a packed step of `rows` real rows runs: the next power of two from
    `MIN_PADDED_ROWS` up to `ROW_BUCKET`, else the next multiple of `ROW_BUCKET`."""
    if rows <= ROW_BUCKET:
        return max(MIN_PADDED_ROWS, 1 << (rows - 1).bit_length())
    return -(-rows // ROW_BUCKET) * ROW_BUCKET


def _qkv(x, w_norm, w_qkv, *, eps: float):
    """The input norm and q, k and v as one matmul -> ``(B, L, (heads + 2 kv_heads)
    head_dim)``."""
    return mx.fast.rms_norm(x, w_norm, eps) @ w_qkv.T


def _pre(x, offset, w_norm, w_qkv, w_q_norm, w_k_norm, *, eps: float, heads: int,
         kv_heads: int, head_dim: int, base: float, scale: float):
    """`_qkv`, q/k norms and RoPE (`base`, positions times `scale`) at an array `offset`
    (one trace serves every position) -> q, k, v ``(B, heads, L, head_dim)``."""
    B, L, _ = x.shape
    qkv = _qkv(x, w_norm, w_qkv, eps=eps)
    q, k, v = mx.split(qkv, [heads * head_dim, (heads + kv_heads) * head_dim], axis=-1)

    def heads_first(y, n, w_n=None):
        y = y.reshape(B, L, n, head_dim)
        return (y if w_n is None else mx.fast.rms_norm(y, w_n, eps)).transpose(0, 2, 1, 3)

    rope = partial(mx.fast.rope, dims=head_dim, traditional=False, base=base, scale=scale,
                   offset=offset)
    return (rope(heads_first(q, heads, w_q_norm)), rope(heads_first(k, kv_heads, w_k_norm)),
            heads_first(v, kv_heads))


def _heads_packed(qkv, positions, w_q_norm, w_k_norm, *, eps: float, heads: int,
                  kv_heads: int, head_dim: int, base: float, scale: float):
    """The fused projection `qkv` ``(1, L, width)`` of rows packed along ``L`` split into
    heads, q and k normed and each row rotated at its own position (`positions`, int32
    ``(L,)``): the rows become RoPE's batch, whose per-batch offsets MLX takes, so a row is
    rotated as `_pre` rotates it in its own job's chunk -> q, k, v ``(1, heads, L,
    head_dim)``. On CUDA `model.kernels.qk_norm_rope` computes the same in one pass."""
    _, L, _ = qkv.shape
    q, k, v = mx.split(qkv, [heads * head_dim, (heads + kv_heads) * head_dim], axis=-1)

    def rows_first(y, n, w_n=None):  # (L, n, 1, head_dim): one row a batch entry
        y = y.reshape(L, n, 1, head_dim)
        return y if w_n is None else mx.fast.rms_norm(y, w_n, eps)

    rope = partial(mx.fast.rope, dims=head_dim, traditional=False, base=base, scale=scale,
                   offset=positions)
    return tuple(y.transpose(2, 1, 0, 3) for y in (  # (1, n, L, head_dim)
        rope(rows_first(q, heads, w_q_norm)), rope(rows_first(k, kv_heads, w_k_norm)),
        rows_first(v, kv_heads)))


def _pre_packed(x, positions, w_norm, w_qkv, w_q_norm, w_k_norm, *, eps: float, heads: int,
                kv_heads: int, head_dim: int, base: float, scale: float):
    """`_pre` over several jobs' rows packed along ``L`` (`x` ``(1, L, hidden)``): `_qkv`
    and `_heads_packed` -> q, k, v ``(1, heads, L, head_dim)``."""
    return _heads_packed(_qkv(x, w_norm, w_qkv, eps=eps), positions, w_q_norm, w_k_norm,
                         eps=eps, heads=heads, kv_heads=kv_heads, head_dim=head_dim, base=base,
                         scale=scale)


def _attn_out(x, attn, w_o, w_post_attn, w_ffn_norm, w_gate_up, *, eps: float):
    """The output projection, the residual and its norms, and the MLP's gate and up as one
    matmul -> the residual stream ``(B, L, hidden)`` and ``gate_up`` ``(B, L, 2 * I)``."""
    B, _, L, _ = attn.shape
    h = x + mx.fast.rms_norm(attn.transpose(0, 2, 1, 3).reshape(B, L, -1) @ w_o.T,
                             w_post_attn, eps)
    return h, mx.fast.rms_norm(h, w_ffn_norm, eps) @ w_gate_up.T


def _mlp_out(h, gated, w_down, w_post_ffw, *, eps: float):
    """The down projection of the gated product `gated` ``(B, L, I)``, normed, added to the
    residual stream `h` -> the layer's output ``(B, L, hidden)``."""
    return h + mx.fast.rms_norm(gated @ w_down.T, w_post_ffw, eps)


def _post(x, attn, w_o, w_post_attn, w_ffn_norm, w_gate_up, w_down, w_post_ffw, *,
          eps: float):
    """`_attn_out`, the GELU-gated product and `_mlp_out` -> the layer's output
    ``(B, L, hidden)``."""
    h, gate_up = _attn_out(x, attn, w_o, w_post_attn, w_ffn_norm, w_gate_up, eps=eps)
    gate, up = mx.split(gate_up, 2, axis=-1)
    return _mlp_out(h, gelu_gate(gate, up), w_down, w_post_ffw, eps=eps)


class GraphForward:
    """``forward(model, inputs, cache, every_position)`` with the same contract as
    `model.archs.gemma3.Model.__call__`, each layer's dense parts compiled around the parts
    that cannot be (the cache update, whose shapes change with the position, and the
    attention). Each function is traced once per (layer kind, chunk length).

    Args:
        attend: ``attend(q, keys, values, scale, position, window, mask)`` -> ``(B, heads,
            L, head_dim)``, the layer's attention over what its cache returned (on CUDA,
            `model.kernels.flash_attention`).
        attend_packed: ``attend_packed(q, keys, values, scale, jobs, window)`` ->
            ``(1, heads, sum(rows), head_dim)``, the attention of several jobs' chunks
            packed along ``L`` in one call, each against its own keys (`jobs`:
            `model.kernels.flash_attention.PackedJob` each; on CUDA,
            `model.kernels.flash_attention.packed_flash_attention`); None: a packed step
            attends job by job.
        gate: ``gate(gate_up)`` -> ``gelu_tanh(gate) * up`` as a kernel of its own (on CUDA,
            `model.kernels.gelu.fused_gelu_gate`), run between the compiled `_attn_out` and
            `_mlp_out` where a layer's gate has at least `GATE_KERNEL_MIN` values; else (or
            None) the compiled `_post` computes it.
        heads: ``heads(qkv, positions, q_norm, k_norm, *, heads, kv_heads, base, scale,
            eps)`` -> q, k, v, `_heads_packed` of a ``(rows, width)`` projection as a kernel
            of its own (on CUDA, `model.kernels.qk_norm_rope.qk_norm_rope`), run after the
            compiled `_qkv` where a chunk's projection has at least `HEADS_KERNEL_MIN`
            values; else (or None) the compiled `_pre` computes them.
        shared_kv_bytes: the most bytes of keys and values a later chunk brings to a packed
            step's `attend_packed` call (`SHARED_KV_BYTES`); above it, or at 0, it attends
            on its own.
    """

    def __init__(self, attend: Attend, attend_packed: Callable[..., mx.array] | None = None,
                 gate: Callable[[mx.array], mx.array] | None = None,
                 heads: Callable[..., tuple[mx.array, mx.array, mx.array]] | None = None,
                 shared_kv_bytes: int = SHARED_KV_BYTES):
        self.attend, self.attend_packed, self.gate, self.heads = attend, attend_packed, gate, heads
        self.shared_kv_bytes = shared_kv_bytes
        self._qkv: Callable | None = None
        self._pre: dict[tuple[bool, float, float], Callable] = {}
        self._post: Callable | None = None
        self._post_halves: tuple[Callable, Callable] | None = None
        self._weights: dict[int, tuple[mx.array, mx.array]] = {}

    def _compiled(self, args, attn, packed: bool = False):
        """(`_pre` or `_pre_packed`, `_post`) compiled, the first for the RoPE of layer
        attention `attn` (its base and scale)."""
        key = packed, attn.rope_base, attn.rope_scale
        if key not in self._pre:
            self._pre[key] = mx.compile(partial(
                _pre_packed if packed else _pre, eps=args.rms_norm_eps,
                heads=args.num_attention_heads, kv_heads=args.num_key_value_heads,
                head_dim=args.head_dim, base=attn.rope_base, scale=attn.rope_scale))
        if self._post is None:
            self._qkv = mx.compile(partial(_qkv, eps=args.rms_norm_eps))
            self._post = mx.compile(partial(_post, eps=args.rms_norm_eps))
            self._post_halves = (mx.compile(partial(_attn_out, eps=args.rms_norm_eps)),
                                 mx.compile(partial(_mlp_out, eps=args.rms_norm_eps)))
        return self._pre[key], self._post

    def _stacked(self, layer: int, block) -> tuple[mx.array, mx.array]:
        """Layer `layer`'s q, k, v weights stacked into one matrix, and gate and up into
        another, built on first use: one matmul each instead of three and two. The copies
        follow the weights the model has then (weights do not change after loading); at Gemma 3
        270M they add ~65M parameters (~130 MB in bf16)."""
        if layer not in self._weights:
            a, f = block.attn, block.mlp
            stacked = (mx.concatenate([a.attn_q.weight, a.attn_k.weight, a.attn_v.weight]),
                       mx.concatenate([f.ffn_gate.weight, f.ffn_up.weight]))
            mx.eval(stacked)
            self._weights[layer] = stacked
        return self._weights[layer]

    def __call__(self, model, inputs: mx.array, cache, every_position: bool = False
                 ) -> mx.array:
        args, position = model.args, cache.position
        h = model.embed(inputs)
        offset = mx.array(position, dtype=mx.int32)
        positions = (None if self.heads is None else
                     mx.arange(position, position + h.shape[1], dtype=mx.int32))
        for layer, block in enumerate(model.blk):
            a = block.attn
            pre, post = self._compiled(args, a)
            w_qkv, w_gate_up = self._stacked(layer, block)
            if self._heads_apply(h, w_qkv, args):
                q, k, v = self._heads_of(h, positions, block, w_qkv, args)
            else:
                q, k, v = pre(h, offset, block.attn_norm.weight, w_qkv, a.attn_q_norm.weight,
                              a.attn_k_norm.weight)
            keys, values, mask = cache[layer].update(k, v, position)
            out = self.attend(q, keys, values, a.scale, position, a.window, mask)
            h = self._post_of(post, h, out, block, w_gate_up)
        return model.output_norm(h if every_position else h[:, -1, :])

    def packed(self, model, inputs: list[mx.array], caches: list,
               every_position: Sequence[bool] | None = None,
               writes: Sequence[bool] | None = None) -> list[mx.array]:
        """Several jobs' chunks in one forward pass, with the contract of
        `model.archs._packed.PackedModel.packed`: the compiled graphs run over every job's
        rows at once (packed along ``L``, each row rotated at its own position). With
        `attend_packed`, a layer's attention is one call for the jobs at position 0 (which
        write their rows to their caches where `writes` says so) and the later chunks
        whose keys take at most ``shared_kv_bytes`` (`_launch_rank`; not a lone one, which
        may split its keys on its own), which update their caches first; the other jobs
        update their caches and attend one by one. The rows are then padded to
        `padded_rows` by a pseudo-job of token id 0 at position 0 placed after the first
        chunks, which attends to itself in the same call, touches no cache and whose
        outputs are dropped: the matmuls are row-wise, so padding moves no real row
        beyond their blocking.

        Args:
            inputs: each job's chunk of token ids, int32 ``(L_i,)``, none empty.
            caches: each job's cache (rows ``[position, position + L_i)`` are written).
            every_position: per job, whether it gets every position's hidden state.
            writes: per job, whether its rows must reach its cache (default: all); a job at
                position 0 that need not keep them writes none.
        Returns:
            per job, float ``(1, hidden)`` or ``(1, L_i, hidden)`` (`every_position`).
        """
        every = list(every_position or [False] * len(inputs))
        writes = list(writes or [True] * len(inputs))
        # the first chunks, then the later ones that share their launch, then the rest
        rank = [self._launch_rank(model.args, cache.position, int(x.shape[0]))
                for x, cache in zip(inputs, caches, strict=True)]
        order: list[int | None] = sorted(range(len(inputs)), key=rank.__getitem__)
        inputs, caches = [inputs[i] for i in order], [caches[i] for i in order]
        every, writes = [every[i] for i in order], [writes[i] for i in order]
        positions = [cache.position for cache in caches]
        fresh = rank.count(0)
        shared = fresh + rank.count(1) if fresh or rank.count(1) > 1 else 0  # else: splits
        total = sum(int(x.shape[0]) for x in inputs)
        if self.attend_packed and padded_rows(total) > total:
            pad = mx.zeros((padded_rows(total) - total,), dtype=mx.int32)
            for values, value in ((order, None), (inputs, pad), (caches, None),
                                  (positions, 0), (every, False), (writes, False)):
                values.insert(fresh, value)
            shared += 1
        outs = self._packed(inputs, caches, positions, shared, every, writes, model)
        by_job = {i: out for i, out in zip(order, outs, strict=True) if i is not None}
        return [by_job[i] for i in range(len(by_job))]

    def _launch_rank(self, args, position: int, rows: int) -> int:
        """Where a job of `rows` rows at `position` goes in a packed step: 0, a first chunk
        in the shared attention call; 1, a later chunk in it, where its keys and values in
        a global layer (``position + rows`` rows of ``kv_heads x head_dim``, bf16) take at
        most ``shared_kv_bytes``; 2, on its own."""
        if not self.attend_packed:
            return 2
        kv_bytes = 2 * (position + rows) * args.num_key_value_heads * args.head_dim * 2
        return 0 if position == 0 else 1 if kv_bytes <= self.shared_kv_bytes else 2

    def _packed(self, inputs: list[mx.array], caches: list, positions: list[int], shared: int,
                every: list[bool], writes: list[bool], model) -> list[mx.array]:
        """`packed` of jobs in order (the first `shared` attend in one call, a padding
        pseudo-job among them with cache None)."""
        args = model.args
        lengths = [int(x.shape[0]) for x in inputs]
        rows = mx.array(np.concatenate([np.arange(p, p + n, dtype=np.int32)
                                        for p, n in zip(positions, lengths, strict=True)]))
        h = model.embed(mx.concatenate(inputs)[None])
        for layer, block in enumerate(model.blk):
            a = block.attn
            pre, post = self._compiled(args, a, packed=True)
            w_qkv, w_gate_up = self._stacked(layer, block)
            if self._heads_apply(h, w_qkv, args):
                q, k, v = self._heads_of(h, rows, block, w_qkv, args)
            else:
                q, k, v = pre(h, rows, block.attn_norm.weight, w_qkv, a.attn_q_norm.weight,
                              a.attn_k_norm.weight)
            layer_caches = [None if c is None else c[layer] for c in caches]
            out = self._attention(a, layer_caches, q, k, v, positions, lengths, shared, writes)
            h = self._post_of(post, h, out, block, w_gate_up)
        return job_outputs(model.output_norm, h, lengths, every)

    def _attention(self, attn, layer_caches: list, q: mx.array, k: mx.array, v: mx.array,
                   positions: list[int], lengths: list[int], shared: int, writes: list[bool]
                   ) -> mx.array:
        """One layer's attention output ``(1, heads, sum(lengths), head_dim)`` for jobs
        packed along ``L``, the first `shared` of them in one `attend_packed` call: the
        first chunks (position 0, which come first) attend to their own rows and write
        them where `writes` says so, the later chunks update their caches and attend to
        what those return. The rest update their caches and attend one by one."""
        starts = np.cumsum([0, *lengths]).tolist()
        fresh = next((i for i in range(shared) if positions[i] > 0), shared)
        outs = []
        if shared:
            for cache, start, n, write in zip(layer_caches[:fresh], starts, lengths[:fresh],
                                              writes, strict=False):
                if write:
                    cache.write(k[:, :, start : start + n], v[:, :, start : start + n], 0)
            # the first chunks' keys are their own rows, one run [0, starts[fresh])
            keys = [k[:, :, :starts[fresh]]] if fresh else []
            values = [v[:, :, :starts[fresh]]] if fresh else []
            jobs = list(fresh_jobs(lengths[:fresh]))
            for i in range(fresh, shared):
                mine = slice(starts[i], starts[i + 1])
                job_keys, job_values, _ = layer_caches[i].update(k[:, :, mine], v[:, :, mine],
                                                                 positions[i])
                keys.append(job_keys)
                values.append(job_values)
                jobs.append(PackedJob(lengths[i], job_keys.shape[2], positions[i]))
            outs.append(self.attend_packed(q[:, :, :starts[shared]], _joined(keys),
                                           _joined(values), attn.scale, tuple(jobs),
                                           attn.window))
        for i in range(shared, len(lengths)):
            mine = slice(starts[i], starts[i + 1])
            keys, values, mask = layer_caches[i].update(k[:, :, mine], v[:, :, mine],
                                                        positions[i])
            outs.append(self.attend(q[:, :, mine], keys, values, attn.scale, positions[i],
                                    attn.window, mask))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)

    def _heads_apply(self, h: mx.array, w_qkv: mx.array, args) -> bool:
        """Whether a layer's q, k and v of the rows `h` ``(B, L, hidden)`` come from the
        `heads` kernel: one sequence of rows (B = 1), head dim 256, and a projection of at
        least `HEADS_KERNEL_MIN` values."""
        return (self.heads is not None and h.shape[0] == 1 and args.head_dim == 256
                and h.shape[1] * w_qkv.shape[0] >= HEADS_KERNEL_MIN)

    def _heads_of(self, h: mx.array, positions: mx.array, block, w_qkv: mx.array, args
                  ) -> tuple[mx.array, mx.array, mx.array]:
        """The compiled `_qkv` of `h` ``(1, L, hidden)``, then the `heads` kernel at
        `positions` (int32 ``(L,)``) -> q, k, v ``(1, heads, L, head_dim)``."""
        a = block.attn
        qkv = self._qkv(h, block.attn_norm.weight, w_qkv)
        return self.heads(qkv.reshape(h.shape[1], -1), positions, a.attn_q_norm.weight,
                          a.attn_k_norm.weight, heads=args.num_attention_heads,
                          kv_heads=args.num_key_value_heads, base=a.rope_base,
                          scale=a.rope_scale, eps=args.rms_norm_eps)

    def _post_of(self, post: Callable, h: mx.array, out: mx.array, block,
                 w_gate_up: mx.array) -> mx.array:
        """`post` (the compiled `_post`) of layer `block` on its input `h` and attention
        output `out`; with the `gate` kernel where it applies, its two compiled halves
        around it."""
        rows = h.size // h.shape[-1]
        if self.gate is None or rows * w_gate_up.shape[0] // 2 < GATE_KERNEL_MIN:
            return post(h, out, block.attn.attn_output.weight, block.post_attention_norm.weight,
                        block.ffn_norm.weight, w_gate_up, block.mlp.ffn_down.weight,
                        block.post_ffw_norm.weight)
        attn_out, mlp_out = self._post_halves
        h, gate_up = attn_out(h, out, block.attn.attn_output.weight,
                              block.post_attention_norm.weight, block.ffn_norm.weight, w_gate_up)
        return mlp_out(h, self.gate(gate_up), block.mlp.ffn_down.weight,
                       block.post_ffw_norm.weight)
