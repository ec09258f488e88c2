"""labkit: the mechanisms behind GPU Memory Labs, importable from notebooks and scripts."""
from importlib.metadata import PackageNotFoundError, version

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

try:
    __version__ = version("gpu-memory-labs")     # pyproject.toml's [project] name and version
except PackageNotFoundError:                     # a source checkout that was never installed
    __version__ = "0+unknown"

__all__ = [
    # models
    "ModelConfig", "preset", "presets", "from_hf_config", "Transformer", "build_model",
    "use_attention", "ParamCount", "count_params",
    # predict
    "Recipe", "Layout", "Estimate", "estimate", "kv_cache_bytes",
    # the papers' own formulas
    "model_state_bytes", "megatron_activation_bytes", "megatron_params", "pipeline_bubble",
    "pipeline_bubble_ratio",
    # measure
    "MemoryTracker", "activations_per_module", "Measurement", "measure_step", "device",
    # bytes
    "CATEGORIES", "Breakdown", "fmt_bytes", "fmt_count", "reconciliation",
]
