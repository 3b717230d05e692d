"""Model architectures, one module (or sub-package) each, found by a GGUF's architecture name.

The lookup works like mlx-lm's `_get_classes` (ml-explore/mlx-lm ``mlx_lm/utils.py``), which
imports ``mlx_lm.models.<model_type>`` with `importlib.import_module` after a small
``MODEL_REMAPPING`` table: here ``general.architecture`` names ``model.archs.<name>``, and
`REMAPPING` lists only the names that differ from their module's. A third architecture is
one module here (plus, to serve it by name, an entry in `model.registry.BUILTIN_MODELS`).

An architecture module provides (see `gemma3`):

- ``ARCHITECTURE``: its ``general.architecture`` name (the module's name; the names
  `REMAPPING` sends to it are variants it reads from the GGUF, as `llama` does).
- ``ModelArgs``, a dataclass with ``from_gguf(gguf) -> ModelArgs`` (metadata only) and
  ``context_length`` and ``vocab_size`` attributes.
- ``load(gguf, dtype) -> Model``: the weights, dequantized to `dtype`.
- ``Model.make_cache(kv_dtype, capacity, context_length, capacity_step=None)``: an empty KV
  cache; it has ``capacity_step`` and ``grow(capacity, snapshot=None)`` (sessions grow it).
- ``cache_plan(args, context_length, kv_dtype)``: the cache's sizes, without allocating it.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from ..gguf.reader import GGUFError

# ``general.architecture`` values whose module has another name: Qwen 2 and 3 are variants of
# the Llama family's module.
REMAPPING: dict[str, str] = {"qwen2": "llama", "qwen3": "llama"}


def supported() -> list[str]:
    """The architecture names `get_arch` accepts, sorted."""
    modules = {m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")}
    return sorted(modules | {name for name, module in REMAPPING.items() if module in modules})


def get_arch(architecture: str) -> ModuleType:
    """The module of `architecture` (a GGUF's ``general.architecture``).

    Raises:
        GGUFError: no module here implements `architecture`; the message lists the
            supported ones.
    """
    name = REMAPPING.get(architecture, architecture)
    if name not in supported():
        raise GGUFError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported())}"
        )
    return importlib.import_module(f"{__name__}.{name}")
