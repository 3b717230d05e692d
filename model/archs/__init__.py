"""Model architectures, one module (or sub-package) each, found by a GGUF's architecture name.

docs/models.md, "Adding an architecture", lists what an architecture module provides.
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

    As mlx-lm's ``_get_classes`` (``mlx_lm/utils.py``) imports ``mlx_lm.models.<model_type>``
    after its ``MODEL_REMAPPING``, this imports ``model.archs.<name>`` after `REMAPPING`.

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
