"""The KV cache of one attention layer: append-only global rows (`GlobalKVCache`) and a
sliding window's ring (`RingKVCache`). `model.kv_cache.ModelCache` holds one per layer.
"""

from __future__ import annotations

import mlx.core as mx

from .cache import RingBuffer, RowLog, window_mask
from .cache_plan import LayerSpec
from .cache_state import BufferView

# Global-attention buffers grow in steps of this many tokens (mlx-lm's KVCache step) when a
# caller did not reserve the exact capacity up front.
CAPACITY_STEP_TOKENS = 256


class GlobalKVCache:
    """Append-only K/V rows for a global-attention layer, shape ``(B, n_kv_heads, T, head_dim)``."""

    def __init__(self, spec: LayerSpec, dtype: mx.Dtype, capacity: int = 0):
        self.spec, self.dtype = spec, dtype
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        if capacity:
            self._grow(capacity, 0)

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def _grow(self, capacity: int, live: int) -> None:
        shape = (1, self.spec.n_kv_heads, capacity, self.spec.head_dim)
        keys, values = mx.zeros(shape, self.dtype), mx.zeros(shape, self.dtype)
        if live:  # migrate the live prefix; rows past it are dead
            keys[:, :, :live, :] = self.keys[:, :, :live, :]
            values[:, :, :live, :] = self.values[:, :, :live, :]
        self.keys, self.values = keys, values

    def update(self, k: mx.array, v: mx.array, position: int) -> tuple[mx.array, mx.array, str]:
        """Write a chunk at `position`; return all keys/values ``[0, position + L)`` and the mask.

        Args:
            k, v: ``(B, n_kv_heads, L, head_dim)``.
        Returns:
            keys, values of shape ``(B, n_kv_heads, position + L, head_dim)`` and the mask
            ``"causal"`` (MLX aligns it to the last key, i.e. query i sits at position + i).
        """
        self.write(k, v, position)
        end = position + k.shape[2]
        return self.keys[:, :, :end, :], self.values[:, :, :end, :], "causal"

    def write(self, k: mx.array, v: mx.array, position: int) -> None:
        """Write a chunk's rows ``(B, n_kv_heads, L, head_dim)`` at `position`, growing the
        buffers as needed, and read nothing back (`update` without its keys)."""
        end = position + k.shape[2]
        if end > self.capacity:
            steps = -(-end // CAPACITY_STEP_TOKENS)
            self._grow(steps * CAPACITY_STEP_TOKENS, position)
        self.keys[:, :, position:end, :] = k.astype(self.dtype)
        self.values[:, :, position:end, :] = v.astype(self.dtype)

    def arrays(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]

    def buffers(self, prefix: str) -> list[BufferView]:
        """Append-only: rows ``[0, position)`` along axis 2 hold data."""
        if self.keys is None:
            return []
        return [BufferView(f"{prefix}.keys", self.keys, 2, 1),
                BufferView(f"{prefix}.values", self.values, 2, 1)]

    def snapshot(self) -> None:
        return None  # append-only: restoring the position hides later rows

    def restore(self, snapshot: None) -> None:
        pass

    def reset(self) -> None:
        pass  # rows past position 0 are dead; nothing to clear

    def rows(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        """Keys and values of positions ``[start, end)``, ``(1, n_kv_heads, end - start,
        head_dim)`` each (views of the buffers; the caller checks the positions are
        committed)."""
        return self.keys[:, :, start:end, :], self.values[:, :, start:end, :]

    def fork(self) -> GlobalKVCache:
        """A twin holding the same rows as values: a write to either leaves the other as it
        was (the first one copies the buffer instead of updating it in place)."""
        twin = GlobalKVCache(self.spec, self.dtype)
        if self.keys is not None:
            twin.keys, twin.values = mx.array(self.keys), mx.array(self.values)
        return twin


class RingKVCache:
    """The last ``window`` K/V rows of a sliding-window layer, row ``p`` at slot ``p % window``.

    A chunk of L queries at position p attends to keys ``(p+i-window, p+i]`` (`window_mask`),
    so it needs the previous ``window - 1`` rows gathered in order plus its own L rows; the
    ring then keeps the newest ``window`` rows.
    """

    def __init__(self, spec: LayerSpec, dtype: mx.Dtype):
        assert spec.window, "RingKVCache needs a window"
        self.spec, self.dtype = spec, dtype
        shape = (1, spec.n_kv_heads, spec.window, spec.head_dim)
        self._k = RingBuffer(mx.zeros(shape, dtype), axis=2)
        self._v = RingBuffer(mx.zeros(shape, dtype), axis=2)
        self.log: RowLog | None = None  # every row written since `ModelCache.keep_rows`

    @property
    def keys(self) -> mx.array:
        return self._k.data

    @property
    def values(self) -> mx.array:
        return self._v.data

    def update(
        self, k: mx.array, v: mx.array, position: int
    ) -> tuple[mx.array, mx.array, mx.array | str | None]:
        """Attend-to keys/values for a chunk at `position`, then keep the newest rows.

        Args:
            k, v: ``(B, n_kv_heads, L, head_dim)``.
        Returns:
            keys, values of shape ``(B, n_kv_heads, n_prev + L, head_dim)`` with
            ``n_prev = min(position, window - 1)``, and a boolean mask ``(L, n_prev + L)``
            (True = attend), ``"causal"`` when the window cannot bind, or None for L == 1.
        """
        W, L = self.spec.window, k.shape[2]
        k, v = k.astype(self.dtype), v.astype(self.dtype)
        n_prev = min(position, W - 1)
        keys = mx.concatenate([self._k.read(position - n_prev, position), k], axis=2)
        values = mx.concatenate([self._v.read(position - n_prev, position), v], axis=2)
        self.write(k, v, position)
        if L == 1:
            return keys, values, None
        if n_prev + L <= W:
            return keys, values, "causal"
        return keys, values, window_mask(position, L, position - n_prev, n_prev + L, W)

    def write(self, k: mx.array, v: mx.array, position: int) -> None:
        """Keep a chunk's rows ``(B, n_kv_heads, L, head_dim)`` at `position` (the newest
        ``window`` of them) and read nothing back (`update` without its keys)."""
        k, v = k.astype(self.dtype), v.astype(self.dtype)
        self._k.write(k, position)
        self._v.write(v, position)
        if self.log is not None:
            self.log.write(position, k, v)

    def rows(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        """Keys and values of positions ``[start, end)``, ``(1, n_kv_heads, end - start,
        head_dim)`` each, from the rows kept since `ModelCache.keep_rows`.

        Raises:
            ValueError: rows were not kept then (the ring holds only the window's).
        """
        if self.log is None:
            raise ValueError(f"rows [{start}, {end}) of a sliding layer were not kept "
                             "(ModelCache.keep_rows)")
        keys, values = self.log.rows(start, end)  # RowLog raises if some were never written
        return keys, values

    def fork(self) -> RingKVCache:
        """A twin holding the same window as values (`GlobalKVCache.fork`), without the kept
        rows (`ModelCache.keep_rows`)."""
        twin = RingKVCache(self.spec, self.dtype)
        twin._k.data, twin._v.data = mx.array(self.keys), mx.array(self.values)
        return twin

    def arrays(self) -> list[mx.array]:
        return [self.keys, self.values]

    def buffers(self, prefix: str) -> list[BufferView]:
        """Rings: saved whole (slot order), ring axis 2."""
        return [BufferView(f"{prefix}.keys", self.keys, 2, None),
                BufferView(f"{prefix}.values", self.values, 2, None)]

    def snapshot(self) -> tuple[mx.array, mx.array]:
        return mx.array(self.keys), mx.array(self.values)

    def restore(self, snapshot: tuple[mx.array, mx.array]) -> None:
        self._k.data, self._v.data = mx.array(snapshot[0]), mx.array(snapshot[1])

    def reset(self) -> None:
        self._k.data = mx.zeros_like(self.keys)
        self._v.data = mx.zeros_like(self.values)
