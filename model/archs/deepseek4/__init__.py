"""DeepSeek-V4: the model (`model`, with `compressor`, `indexer`, `moe`, `layers`), its
cache plan (`planning`) and compressed KV cache (`cache`)."""

from .cache import Deepseek4Cache
from .compressor import Compressor
from .dummy import dummy_model
from .indexer import Indexer
from .model import ARCHITECTURE, Attention, Block, Model, ModelArgs, flash_args, load
from .moe import MoE, expert_path
from .planning import Deepseek4CachePlan
from .planning import plan as cache_plan

__all__ = [
    "ARCHITECTURE",
    "Attention",
    "Block",
    "Compressor",
    "Deepseek4Cache",
    "Deepseek4CachePlan",
    "Indexer",
    "Model",
    "ModelArgs",
    "MoE",
    "cache_plan",
    "dummy_model",
    "expert_path",
    "flash_args",
    "load",
]
