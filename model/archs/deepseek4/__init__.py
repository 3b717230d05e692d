"""DeepSeek-V4 (the seeds' architecture): the model, its compressed KV cache and plan."""

from .cache import plan as cache_plan
from .model import (
    ARCHITECTURE,
    Model,
    ModelArgs,
    dummy_model,
    flash_args,
    load,
    use_grouped_experts,
)

__all__ = [
    "ARCHITECTURE",
    "Model",
    "ModelArgs",
    "cache_plan",
    "dummy_model",
    "flash_args",
    "load",
    "use_grouped_experts",
]
