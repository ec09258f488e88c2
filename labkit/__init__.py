"""labkit: the mechanisms behind GPU Memory Labs, importable from notebooks and scripts."""
from .config import ModelConfig, preset, presets
from .model import Transformer, build_model
from .estimate import ParamCount, count_params, estimate, kv_cache_bytes
from .papers import (megatron_activation_bytes, megatron_params, model_state_bytes,
                     pipeline_bubble, pipeline_bubble_ratio)
from .track import CATEGORIES, MemoryTracker, activations_per_module, measure_step
from .train import device
from .units import Breakdown, fmt_bytes, fmt_count, reconciliation
