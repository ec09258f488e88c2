"""labkit: the mechanisms behind GPU Memory Labs, importable from notebooks and scripts.

Names load on first use (PEP 562): ``import labkit`` imports no torch, so the estimate
(``labkit.estimate``, ``labkit.Recipe``, ``labkit.Layout``) runs where torch is not installed.
"""
import importlib
import importlib.util
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gpu-memory-labs")     # pyproject.toml's [project] name and version
except PackageNotFoundError:                     # a source checkout that was never installed
    __version__ = "0+unknown"

# public name -> the module that defines it
_HOMES = {
    # the core: configurations, presets, the vocabulary of a step, bytes
    "ModelConfig": "core.config", "preset": "core.config", "presets": "core.config",
    "from_hf_config": "core.hf", "Recipe": "core.recipe", "Layout": "core.recipe",
    "CATEGORIES": "core.units", "Breakdown": "core.units", "fmt_bytes": "core.units",
    "fmt_count": "core.units", "reconciliation": "core.units",
    # the estimate, and the papers' own formulas
    "ParamCount": "predict.layers", "count_params": "predict.layers",
    "Estimate": "predict", "estimate": "predict", "kv_cache_bytes": "predict",
    "model_state_bytes": "predict.papers", "megatron_activation_bytes": "predict.papers",
    "megatron_params": "predict.papers", "pipeline_bubble": "predict.papers",
    "pipeline_bubble_ratio": "predict.papers",
    # the model, and measuring its step
    "Transformer": "transformer.model", "build_model": "transformer.model",
    "use_attention": "transformer.model",
    "MemoryTracker": "training.track", "activations_per_module": "training.track",
    "Measurement": "training.measure", "measure_step": "training.measure",
    "device": "training.step",
}
__all__ = list(_HOMES)


def __getattr__(name: str):
    """A public name from its module, or a subpackage (``labkit.parallel``), imported now."""
    if name in _HOMES:
        value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
