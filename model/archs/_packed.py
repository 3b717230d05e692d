"""Several jobs' chunks in one forward pass (`model.chunk.launch_packed`): `PackedModel`,
`ProjectedAttention` and `attend_each`, shared by the architectures that pack (`gemma3`,
`llama`).

The chunks lie one after another along ``L``, ``(1, sum(lengths), ...)``: embedding, norms,
projections and MLP run over every row at once; attention and the outputs are per job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx

from ..kv_cache import ModelCache

# One job's attention from its projected rows: ``(q, k, v, layer cache, position)`` -> rows.
Attend = Callable[[mx.array, mx.array, mx.array, object, int], mx.array]


def attend_each(attend: Attend, q: mx.array, k: mx.array, v: mx.array, caches: list,
                positions: list[int], lengths: list[int]) -> mx.array:
    """`attend` each job's rows of the packed projections against its own layer cache at its
    own position.

    Args:
        attend: one job's attention (e.g. ``gemma3.Attention.attend``).
        q, k, v: the projections of every job's rows, ``(1, sum(lengths), width)``.
        caches: each job's cache of this layer.
        positions: each job's first position, in tokens.
        lengths: each job's rows, in tokens.
    Returns:
        what `attend` returns for each job, concatenated along ``L``:
        ``(1, sum(lengths), heads * head_dim)``.
    """
    outs, start = [], 0
    for cache, position, n in zip(caches, positions, lengths, strict=True):
        rows = slice(start, start + n)
        outs.append(attend(q[:, rows], k[:, rows], v[:, rows], cache, position))
        start += n
    return mx.concatenate(outs, axis=1)


class ProjectedAttention:
    """`__call__` and `packed` of an attention module with ``attn_q``, ``attn_k``, ``attn_v``
    and ``attn_output`` projections and an ``attend(q, k, v, layer cache, position)`` that
    takes one job's projected rows (``gemma3.Attention``, ``llama.Attention``)."""

    attn_q: Callable[[mx.array], mx.array]
    attn_k: Callable[[mx.array], mx.array]
    attn_v: Callable[[mx.array], mx.array]
    attn_output: Callable[[mx.array], mx.array]
    attend: Attend

    def __call__(self, x: mx.array, cache, position: int) -> mx.array:
        """One job's chunk ``(B, L, hidden)`` at `position` -> ``(B, L, hidden)``."""
        return self.attn_output(self.attend(self.attn_q(x), self.attn_k(x), self.attn_v(x),
                                            cache, position))

    def packed(self, x: mx.array, caches: list, positions: list[int], lengths: list[int]
               ) -> mx.array:
        """Several jobs' chunks packed along ``L`` (``(1, sum(lengths), hidden)``): the
        projections run over every row at once, attention per job against its own cache
        at its own position (`attend_each`); ``(1, sum(lengths), hidden)``."""
        q, k, v = self.attn_q(x), self.attn_k(x), self.attn_v(x)
        return self.attn_output(attend_each(self.attend, q, k, v, caches, positions, lengths))


class PackedModel:
    """`packs` and `packed` of an architecture's ``Model``: a mixin for one with
    ``embed(inputs)``, ``blk`` (blocks with ``packed(x, layer caches, positions,
    lengths)``) and ``output_norm``. A model with another forward path (Gemma 3's
    compiled graphs) overrides `packs` and `packed`."""

    blk: Sequence
    output_norm: Callable[[mx.array], mx.array]

    def embed(self, inputs: mx.array) -> mx.array:
        """Token ids, int32 ``(..., L)`` -> the first block's input ``(..., L, hidden)``."""
        raise NotImplementedError

    def packs(self, caches: list[ModelCache]) -> bool:
        """Whether `packed` serves chunks of `caches`."""
        return True

    def packed(self, inputs: list[mx.array], caches: list[ModelCache],
               every_position: Sequence[bool] | None = None,
               writes: Sequence[bool] | None = None) -> list[mx.array]:
        """One forward pass over several jobs' chunks, each at its own ``cache.position``,
        without committing them: the embedding, norms, projections and MLP run over every
        job's rows at once (packed along ``L``), attention per job against its own cache.

        Args:
            inputs: each job's chunk of token ids, int32 ``(L_i,)``, none empty.
            caches: each job's cache (rows ``[position, position + L_i)`` are written).
            every_position: per job, whether it gets every position's hidden state (prompt
                log-probabilities); None: none does.
            writes: per job, whether its rows must reach its cache; this forward writes
                every job's rows whatever it says (a model may skip those it need not).
        Returns:
            per job, float ``(1, hidden)``: the final-normed hidden state of its chunk's last
            position, or ``(1, L_i, hidden)`` of every position where `every_position` says
            so.
        """
        lengths = [int(x.shape[0]) for x in inputs]
        positions = [cache.position for cache in caches]
        h = self.embed(mx.concatenate(inputs)[None])
        for layer, block in enumerate(self.blk):
            h = block.packed(h, [cache[layer] for cache in caches], positions, lengths)
        every = every_position or [False] * len(lengths)
        return job_outputs(self.output_norm, h, lengths, every)


def job_outputs(norm: Callable[[mx.array], mx.array], h: mx.array, lengths: list[int],
                every_position: Sequence[bool]) -> list[mx.array]:
    """`norm` of each job's last row of `h` ``(1, sum(lengths), hidden)``, as ``(1,
    hidden)``, or of all its rows, as ``(1, L_i, hidden)``, where `every_position` says so;
    one `norm` over just those rows."""
    rows, start = [], 0
    for n, every in zip(lengths, every_position, strict=True):
        rows.extend(range(start, start + n) if every else [start + n - 1])
        start += n
    normed = norm(h[0, mx.array(rows)])  # (rows, hidden)
    outs, start = [], 0
    for n, every in zip(lengths, every_position, strict=True):
        kept = n if every else 1
        out = normed[start : start + kept]
        outs.append(out[None] if every else out)
        start += kept
    return outs
