"""labkit: the mechanisms behind GPU Memory Labs, importable from notebooks and scripts."""
from .config import ModelConfig, preset, presets
from .hf import from_hf_config
from .model import Transformer, build_model, use_attention
from .layers import ParamCount, count_params
from .predict import Estimate, estimate, kv_cache_bytes
from .recipe import Layout, Recipe
from .papers import (megatron_activation_bytes, megatron_params, model_state_bytes,
                     pipeline_bubble, pipeline_bubble_ratio)
from .track import MemoryTracker, activations_per_module
from .measure import Measurement, measure_step
from .train import device
from .units import CATEGORIES, Breakdown, fmt_bytes, fmt_count, reconciliation
