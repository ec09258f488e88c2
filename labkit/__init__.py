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
    # models
    "ModelConfig": "config", "preset": "config", "presets": "config",
    "from_hf_config": "hf", "Transformer": "model", "build_model": "model",
    "use_attention": "model", "ParamCount": "layers", "count_params": "layers",
    # predict
    "Recipe": "recipe", "Layout": "recipe", "Estimate": "predict", "estimate": "predict",
    "kv_cache_bytes": "predict",
    # the papers' own formulas
    "model_state_bytes": "papers", "megatron_activation_bytes": "papers",
    "megatron_params": "papers", "pipeline_bubble": "papers", "pipeline_bubble_ratio": "papers",
    # measure
    "MemoryTracker": "track", "activations_per_module": "track", "Measurement": "measure",
    "measure_step": "measure", "device": "step",
    # bytes
    "CATEGORIES": "units", "Breakdown": "units", "fmt_bytes": "units", "fmt_count": "units",
    "reconciliation": "units",
}
__all__ = list(_HOMES)


def __getattr__(name: str):
    """A public name from its module, or a submodule (``labkit.parallel``), imported now."""
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
