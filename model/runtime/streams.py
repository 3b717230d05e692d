"""Run an op on slices of its input on several CPU streams at once.

MLX's CPU backend runs a stream's non-BLAS ops (exp, tanh, softmax) on that stream's one
thread, and they are most of a Gemma 3 chunk on the CPU (docs/benchmarks.md); slices on one
stream per core run in parallel, each computed exactly as in the whole op. On a GPU (one
stream, already parallel) `split_map` just calls the function.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from functools import cache

import mlx.core as mx


def cpu_streams() -> int:
    """Slices `split_map` makes: ``$PREFILLQ_CPU_STREAMS`` if set (1 turns splitting off),
    else the cores this process may run on (its affinity, not the machine's count).

    Raises:
        ValueError: ``$PREFILLQ_CPU_STREAMS`` is not a positive integer.
    """
    value = os.environ.get("PREFILLQ_CPU_STREAMS")
    if value is not None:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"PREFILLQ_CPU_STREAMS={value!r}: want a positive integer")
        return int(value)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


# Below this many elements in the first split array, `split_map` runs the op whole: the
# streams' dispatch and join cost more than the slices save. Measured 2026-12-05 on a 2-core
# VM: the tiny Gemma 3 (arrays of tens of thousands) ran 6.6 ms instead of 7.4 for 20
# tokens and 28.1 instead of 34.2 for 300 unsplit; Gemma 3 270M was the same split or not at
# 16 and 128 tokens (GELU inputs of 32K and 262K elements) and 6% faster split at 512 (1M).
MIN_SPLIT_ELEMENTS = 1 << 19


@cache
def _streams(n: int) -> tuple[mx.Stream, ...]:
    return tuple(mx.new_stream(mx.cpu) for _ in range(n))


def split_map(
    fn: Callable[..., mx.array],
    split: Sequence[mx.array],
    axis: int,
    shared: Sequence[object] = (),
    parts: int | None = None,
) -> mx.array:
    """``fn(*split, *shared)``, computed in `parts` slices along `axis` on parallel CPU
    streams when the default device is the CPU.

    Args:
        fn: maps slices of `split` (and `shared`, passed whole) to an array whose `axis`
            matches theirs, independently per index along `axis` (rows of a GELU, heads of
            an attention): that is what makes the split exact.
        split: arrays of equal size along `axis`.
        axis: the axis to slice.
        shared: further arguments passed unsliced.
        parts: slices (default `cpu_streams()`, at most the axis size; by default none
            when ``split[0]`` has fewer than `MIN_SPLIT_ELEMENTS` elements).
    Returns:
        The same array as ``fn(*split, *shared)``.
    """
    size = split[0].shape[axis]
    if parts is None and split[0].size < MIN_SPLIT_ELEMENTS:
        return fn(*split, *shared)
    parts = min(parts or cpu_streams(), size)
    if parts <= 1 or mx.default_device() != mx.cpu:
        return fn(*split, *shared)
    bounds = [size * i // parts for i in range(parts + 1)]
    outs = []
    for stream, lo, hi in zip(_streams(parts), bounds, bounds[1:], strict=False):
        index = (slice(None),) * (axis % split[0].ndim) + (slice(lo, hi),)
        with mx.stream(stream):
            outs.append(fn(*(a[index] for a in split), *shared))
    return mx.concatenate(outs, axis=axis)
