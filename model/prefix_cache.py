"""A worker's prefix cache: KV rows of prompt prefixes kept across jobs, no session id needed.

Prompts are cut into blocks of B tokens, each named by a key its caller gives
(`jobs.prefixes.block_keys`: SHA-256 chained from a root over the model file, the cache
layout and a salt, the same in every process). A block holds every layer's keys and values
of its positions, the sliding layers' included (`ModelCache.keep_rows` keeps them while a
prompt is prefilled), so a reuse may end at any block edge: a cache restored from m blocks
holds each sliding layer's window before position ``m * B``. Blocks are evicted least
recently used first, within a byte budget, a prefix's last blocks before its first (a block
is touched after its descendants, so the blocks kept always form whole prefixes from the
root).

Scope: `model.kv_cache.ModelCache` (Gemma 3, the Llama family); DeepSeek-V4's compressed
cache is not cut into blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .chunk import PrefillModel
from .kv_cache import ModelCache
from .logprobs import PromptLogprobs
from .planner import check_prompt, plan_chunks
from .prefill import Prefill

PREFIX = "prefix"  # ``Prefill.reuse`` of a prefill that started from held blocks


@dataclass(frozen=True)
class BlockLogprobs:
    """A block's prompt log-probabilities (`model.logprobs.PromptLogprobs` entries): those
    after each of its positions but the last, ``token_logprob`` float32 ``(B - 1,)`` and the
    top K ``top_ids`` int32 / ``top_logprobs`` float32 ``(B - 1, K)``; and its last position's
    final-normed hidden state, float ``(1, hidden)``, from which the entry after it is
    computed for whatever token follows (`PromptLogprobs.fill_prefix`)."""

    token_logprob: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    hidden: mx.array

    @property
    def k(self) -> int:
        return self.top_ids.shape[1]

    @property
    def nbytes(self) -> int:
        return (self.token_logprob.nbytes + self.top_ids.nbytes + self.top_logprobs.nbytes
                + self.hidden.nbytes)


@dataclass(frozen=True)
class PrefixBlock:
    """One block's rows: per layer, keys and values ``(1, n_kv_heads, block_tokens,
    head_dim)`` (copies, evaluated), their bytes, and its prompt log-probabilities when the
    job that kept it asked for them (None otherwise)."""

    rows: tuple[tuple[mx.array, mx.array], ...]
    nbytes: int
    logprobs: BlockLogprobs | None = None


class PrefixCache:
    """Blocks of prompt prefixes by key (`block_keys`), least recently used evicted first
    once their bytes pass `max_bytes`.

    Args:
        max_bytes: the blocks' bytes held at most (a block bigger than it is not kept).
        block_tokens: tokens a block; keys must be made with the same.
    Raises:
        ValueError: a negative `max_bytes` or `block_tokens` < 1.
    """

    def __init__(self, max_bytes: int, block_tokens: int):
        if max_bytes < 0 or block_tokens < 1:
            raise ValueError(f"max_bytes must be >= 0 and block_tokens >= 1, got {max_bytes} "
                             f"and {block_tokens}")
        self.max_bytes, self.block_tokens = max_bytes, block_tokens
        self._blocks: OrderedDict[bytes, PrefixBlock] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def _usable(self, key: bytes, k: int | None) -> bool:
        """Whether block `key` is held, with prompt logprobs of at least `k` (None: any)."""
        block = self._blocks.get(key)
        return block is not None and (k is None or (block.logprobs is not None
                                                    and block.logprobs.k >= k))

    def longest(self, keys: Sequence[bytes], k: int | None = None) -> int:
        """How many of `keys`, from the first, are held (a prompt's reusable blocks), with
        prompt logprobs of at least `k` top entries where `k` is given; those become the
        most recently used."""
        n = 0
        while n < len(keys) and self._usable(keys[n], k):
            n += 1
        self._touch(keys[:n])
        return n

    def get(self, key: bytes) -> PrefixBlock | None:
        """Block `key` if held (its use is not recorded)."""
        return self._blocks.get(key)

    def add(self, keys: Sequence[bytes], blocks: Sequence[PrefixBlock]) -> None:
        """Hold `blocks` (fetched from a shared store: `model.prefix_state`) as the blocks
        of `keys` (one prefix's, in order), replacing any held, touched as `longest`
        touches a prefix (its tail evicted first); then evict past `max_bytes`."""
        for key, block in zip(keys, blocks, strict=True):
            held = self._blocks.pop(key, None)
            if held is not None:
                self.nbytes -= held.nbytes
            self._blocks[key] = block
            self.nbytes += block.nbytes
        self._touch(keys)
        self._evict()

    def missing(self, keys: Sequence[bytes], k: int | None = None) -> bool:
        """Whether `insert` would add or complete a block of `keys` (one not held, or held
        without prompt logprobs of `k` top entries where `k` is given)."""
        return not all(self._usable(key, k) for key in keys)

    def insert(self, keys: Sequence[bytes], cache: ModelCache,
               logprobs: PromptLogprobs | None = None) -> int:
        """Keep the blocks of `keys` that are not held yet, their rows copied from `cache`
        (block i: positions ``[i * block_tokens, (i + 1) * block_tokens)``), with their
        prompt logprobs from `logprobs` when it is given and kept the hidden states of the
        block ends (``block_tokens``; a held block whose logprobs kept fewer top entries, or
        none, gets these), then evict past `max_bytes`. Returns the blocks added or
        completed.

        Raises:
            ValueError: `cache` has not committed those positions, or a sliding layer did
                not keep their rows (`ModelCache.keep_rows`).
        """
        B, added = self.block_tokens, []
        with_logprobs = logprobs is not None and logprobs.block_tokens == B
        for i, key in enumerate(keys):
            held = self._blocks.get(key)
            lp = _block_logprobs(logprobs, i, B) if with_logprobs else None
            if held is not None and (lp is None or self._usable(key, lp.k)):
                continue
            rows = held.rows if held is not None else tuple(
                (mx.contiguous(k), mx.contiguous(v)) for k, v in cache.rows(i * B, (i + 1) * B))
            added.append((key, rows, lp))
        mx.eval([a for _, rows, _ in added for kv in rows for a in kv],
                [lp.hidden for _, _, lp in added if lp is not None])
        for key, rows, lp in added:
            if key in self._blocks:
                self.nbytes -= self._blocks[key].nbytes
            block = PrefixBlock(rows, sum(a.nbytes for kv in rows for a in kv)
                                + (lp.nbytes if lp is not None else 0), lp)
            self._blocks[key] = block
            self.nbytes += block.nbytes
        self._touch(keys)
        self._evict()
        return len(added)

    def restore(self, keys: Sequence[bytes], cache: ModelCache,
                logprobs: PromptLogprobs | None = None, model: PrefillModel | None = None
                ) -> int:
        """Write the blocks of `keys` (all held: `longest` first) into `cache`, empty, as if
        their tokens had been prefilled: global layers get every row, sliding layers their
        window's (and all of them where `cache` keeps rows); and with `logprobs` (and the
        `model`, whose head computes each block's last entry), fill its entries up to the
        position reached (`PromptLogprobs.fill_prefix`). Returns that position,
        ``len(keys) * block_tokens``.

        Raises:
            KeyError: a block is not held. ValueError: `cache` is not empty and settled, or
            a block has no prompt logprobs of `logprobs.k` entries.
            ContextExhausted: the blocks pass the cache's context.
        """
        blocks = [self._blocks[key] for key in keys]
        if cache.position or cache.in_flight:
            raise ValueError(f"restore needs an empty cache; this one is at {cache.position} "
                             f"with {cache.in_flight} tokens in flight")
        n = len(blocks) * self.block_tokens
        if not n:
            return 0
        cache.check_chunk(n)
        cache.begin(n)
        for i, layer in enumerate(cache.layers):
            layer.write(mx.concatenate([b.rows[i][0] for b in blocks], axis=2),
                        mx.concatenate([b.rows[i][1] for b in blocks], axis=2), 0)
        mx.eval(cache.arrays())
        cache.commit(n)
        if logprobs is not None:
            if any(b.logprobs is None for b in blocks):
                raise ValueError("restore with prompt logprobs needs blocks that kept them")
            logprobs.fill_prefix(
                model, [(b.logprobs.token_logprob, b.logprobs.top_ids, b.logprobs.top_logprobs)
                        for b in blocks],
                mx.concatenate([b.logprobs.hidden for b in blocks]), self.block_tokens)
        self._touch(keys)
        return n

    def _touch(self, keys: Sequence[bytes]) -> None:
        """Make the blocks of `keys` (one prefix's, in order) the most recently used, each
        block more recent than those after it, so eviction takes a prefix's tail first."""
        for key in reversed(keys):
            self._blocks.move_to_end(key)

    def _evict(self) -> None:
        while self.nbytes > self.max_bytes and self._blocks:
            _, block = self._blocks.popitem(last=False)
            self.nbytes -= block.nbytes


def _block_logprobs(logprobs: PromptLogprobs, i: int, B: int) -> BlockLogprobs | None:
    """Block `i`'s entries of `logprobs` (positions ``i * B + 1 .. (i + 1) * B - 1``) and
    its last position's hidden state, or None when they are not all recorded."""
    hidden = logprobs.block_hidden.get(i)
    if hidden is None or logprobs.filled < (i + 1) * B - 1:
        return None
    rows = slice(i * B + 1, (i + 1) * B)
    return BlockLogprobs(logprobs.token_logprob[rows].copy(), logprobs.top_ids[rows].copy(),
                         logprobs.top_logprobs[rows].copy(), mx.contiguous(hidden))


def token_bytes(cache: ModelCache) -> int:
    """Bytes one token's keys and values take over every layer of `cache`: what a block
    costs per token, sliding layers included."""
    return sum(2 * s.n_kv_heads * s.head_dim for s in cache.specs) * cache.kv_dtype.size


def prefix_prefill(model: PrefillModel, token_ids: Sequence[int], prefixes: PrefixCache,
                   keys: Sequence[bytes], *, vocab_size: int, context_length: int,
                   chunk_tokens: int | None = None, kv_dtype: mx.Dtype = mx.float32,
                   prompt_logprobs: int | None = None, keep_cache: bool = False
                   ) -> tuple[Prefill, list[bytes]]:
    """A prefill of `token_ids` that starts from the longest prefix `prefixes` holds, and the
    keys of the blocks to insert into it once the prefill is done (`PrefixCache.insert`).

    The cursor starts at the end of the held blocks (``cached_tokens``, ``reuse`` `PREFIX`;
    ``cold`` and 0 when none is held); a prompt held whole still runs its last block, so the
    final logits come from a forward pass. The rest is planned as a cold prefill's chunks from
    there (`model.planner.plan_chunks`). A prefill with `prompt_logprobs` K reuses only
    blocks that kept prompt logprobs of at least K top entries, and gets their entries
    (`PromptLogprobs.fill_prefix`). The prompt's blocks are captured (`ModelCache.keep_rows`,
    its last chunk writes its rows, and with `prompt_logprobs` the block ends' hidden states
    are kept) when some are not held yet, or held with fewer logprobs, and all of them fit
    in the budget; the returned keys are empty otherwise. A model whose
    cache is not a `ModelCache` (DeepSeek-V4's compressed cache) runs cold, capturing nothing.

    Args:
        prefixes: the worker's held blocks.
        keys: the key of each whole block of `token_ids` (``len(token_ids) //
            prefixes.block_tokens`` of them: `jobs.prefixes.block_keys`, whose root names
            the model file, this cache's layout and a salt).
        keep_cache: the cache is read once the prefill is done (continuations are scored
            from it), so the last chunk writes its rows even when no block is captured.
        The others: as `model.start.start_prefill`.
    Returns:
        the prefill, and `keys` when its blocks are to be inserted (else empty).
    Raises:
        ValueError: no ids, an id outside the vocabulary, more ids than `context_length`
            (`model.planner.check_prompt`), or not one key a whole block.
    """
    ids = check_prompt(token_ids, vocab_size, context_length)
    cache = model.make_cache(kv_dtype, capacity=len(ids), context_length=context_length)
    logprobs = None if prompt_logprobs is None else PromptLogprobs(ids, prompt_logprobs,
                                                                   vocab_size)
    if not isinstance(cache, ModelCache):  # a compressed cache is not cut into blocks
        return Prefill(model=model, token_ids=ids, cache=cache, logprobs=logprobs, plan=(
            plan_chunks(len(ids), model.sliding_window, chunk_tokens=chunk_tokens)),
                       keep_cache=keep_cache), []
    B = prefixes.block_tokens
    if len(keys) != len(ids) // B:
        raise ValueError(f"{len(keys)} keys for {len(ids) // B} whole blocks of {B} tokens")
    k = None if logprobs is None else logprobs.k
    held = prefixes.longest(keys[: (len(ids) - 1) // B], k)
    capture = (prefixes.missing(keys, k)
               and len(keys) * B * token_bytes(cache) <= prefixes.max_bytes)
    if capture:
        cache.keep_rows()
        if logprobs is not None:
            logprobs.block_tokens = B
    position = prefixes.restore(keys[:held], cache, logprobs, model)
    plan = plan_chunks(len(ids), model.sliding_window, chunk_tokens=chunk_tokens,
                       cursor=position)
    prefill = Prefill(model=model, token_ids=ids, plan=plan, cache=cache, logprobs=logprobs,
                      cached_tokens=position, reuse=PREFIX if position else "cold",
                      keep_cache=capture or keep_cache)
    return prefill, list(keys) if capture else []
