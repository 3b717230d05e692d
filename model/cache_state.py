"""A cache as named raw little-endian blobs plus a msgpack/JSON-able dict, and back.

Every blob is the C-order bytes of one buffer with its row axis moved first, so rows
``[0, N)`` followed by rows ``[N, M)`` are the bytes of rows ``[0, M)``: an incremental
writer appends. bfloat16 is stored as its uint16 bit pattern, so every dtype is exact.
No pickle, no ``np.save``. The cache types and their checks are in `model.cache`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

# Bumped when the meaning of a field or the blob layout changes.
STATE_VERSION = 1

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# dtype -> (same-width unsigned type, its little-endian numpy code)
_BITS = {
    mx.float32: (mx.uint32, "<u4"),
    mx.float16: (mx.uint16, "<u2"),
    mx.bfloat16: (mx.uint16, "<u2"),
}


def dtype_bytes(dtype: mx.Dtype) -> int:
    return dtype.size


def dtype_name(dtype: mx.Dtype) -> str:
    """``mx.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).rsplit(".", 1)[-1]


def to_bytes(a: mx.array) -> bytes:
    """C-order little-endian bytes of `a` (float32, float16 or bfloat16), bit-exact."""
    bits, code = _BITS[a.dtype]
    return np.asarray(a.view(bits)).astype(code, copy=False).tobytes()


def from_bytes(data: bytes, dtype: mx.Dtype, shape: tuple[int, ...]) -> mx.array:
    """Inverse of `to_bytes`. The caller checked ``len(data)``."""
    bits, code = _BITS[dtype]
    return mx.array(np.frombuffer(data, code).reshape(shape).astype(code[1:])).view(dtype)


@dataclass(frozen=True)
class BufferView:
    """One buffer of a cache as its state sees it.

    Attributes:
        name: blob name, e.g. ``layers.3.keys``.
        array: the live buffer (written in place by `load_buffers`).
        row_axis: the axis of rows (of tokens, compressed groups or ring slots).
        ratio: tokens per row of an append-only buffer (rows ``[0, position // ratio)``
            hold data), or None for a fixed buffer saved whole.
    """

    name: str
    array: mx.array
    row_axis: int
    ratio: int | None

    def rows_at(self, position: int) -> int:
        return self.array.shape[self.row_axis] if self.ratio is None else position // self.ratio

    def rows(self, start: int, stop: int) -> mx.array:
        """Rows ``[start, stop)``, row axis first."""
        index = (slice(None),) * self.row_axis + (slice(start, stop),)
        return mx.moveaxis(self.array[index], self.row_axis, 0)


@dataclass
class CacheState:
    """What a checkpoint or a session stores.

    Attributes:
        meta: msgpack/JSON-able: version, cache type, architecture, kv_dtype, layer shapes,
            position, capacity, context_length, ``since`` (0 for a complete state) and
            ``blobs``: per blob its name, dtype, rows-first shape, ``append_only`` and
            ``first_row``.
        blobs: name -> raw little-endian bytes.
    """

    meta: dict
    blobs: dict[str, bytes] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.blobs.values())

    def extend(self, later: CacheState) -> CacheState:
        """This complete state followed by ``later = cache.state(since=self position)``.

        Raises:
            ValueError: `later` does not start at this state's position.
        """
        if later.meta["since"] != self.meta["position"] or self.meta["since"] != 0:
            raise ValueError(
                f"state since {later.meta['since']} does not extend one at "
                f"{self.meta['position']} (since {self.meta['since']})"
            )
        entries, blobs = [], {}
        old = {e["name"]: e for e in self.meta["blobs"]}
        for entry in later.meta["blobs"]:
            name, entry = entry["name"], dict(entry)
            blobs[name] = later.blobs[name]
            if entry["append_only"]:
                blobs[name] = self.blobs[name] + blobs[name]
                entry["shape"] = [old[name]["shape"][0] + entry["shape"][0], *entry["shape"][1:]]
                entry["first_row"] = 0
            entries.append(entry)
        return CacheState({**later.meta, "since": 0, "blobs": entries}, blobs)


def save_buffers(meta: dict, buffers: list[BufferView], since: int, position: int) -> CacheState:
    """Blobs of `buffers` at `position` (append-only ones from row ``rows_at(since)``)."""
    mx.eval([b.array for b in buffers])
    entries, blobs = [], {}
    for b in buffers:
        first = b.rows_at(since) if b.ratio is not None else 0
        rows = b.rows(first, b.rows_at(position))
        blobs[b.name] = to_bytes(rows)
        entries.append({
            "name": b.name,
            "dtype": dtype_name(b.array.dtype),
            "shape": list(rows.shape),
            "append_only": b.ratio is not None,
            "first_row": first,
        })
    return CacheState({**meta, "since": since, "blobs": entries}, blobs)


def load_buffers(state: CacheState, buffers: list[BufferView], position: int) -> None:
    """Write the blobs of a complete `state` into `buffers` (in place), checking each.

    Raises:
        ValueError: naming the blob that is missing, extra, or of the wrong dtype, shape,
            size or first row, or a state that is incremental (``since`` > 0).
    """
    if state.meta.get("since") != 0:
        raise ValueError(f"state since {state.meta.get('since')!r} is not a complete state")
    entries = {e.get("name"): e for e in state.meta.get("blobs", [])}
    extra = set(entries) - {b.name for b in buffers}
    if extra:
        raise ValueError(f"unexpected blobs {sorted(extra)}")
    for b in buffers:
        entry = entries.get(b.name)
        if entry is None or b.name not in state.blobs:
            raise ValueError(f"blob {b.name} is missing")
        shape = list(b.rows(0, b.rows_at(position)).shape)
        _check_entry(entry, b, shape, len(state.blobs[b.name]))
        rows = mx.moveaxis(from_bytes(state.blobs[b.name], b.array.dtype, shape), 0, b.row_axis)
        index = (slice(None),) * b.row_axis + (slice(0, shape[0]),)
        b.array[index] = rows


def _check_entry(entry: dict, b: BufferView, shape: list[int], size: int) -> None:
    want = {"dtype": dtype_name(b.array.dtype), "shape": shape,
            "append_only": b.ratio is not None, "first_row": 0}
    for key, value in want.items():
        if entry.get(key) != value:
            raise ValueError(f"blob {b.name} {key} is {entry.get(key)!r}, expected {value!r}")
    expected = math.prod(shape) * dtype_bytes(b.array.dtype)
    if size != expected:
        raise ValueError(f"blob {b.name} has {size} bytes, expected {expected}")
