"""Activation recomputation ("checkpointing") policies applied to a ``labkit.model.Transformer``.

- ``none``: keep every activation for the backward pass.
- ``full``: keep only each block's input; recompute the block in the backward pass
  (Chen et al., 2016, with one segment per layer).
"""
from __future__ import annotations

from .train import check_choice

RECOMPUTE_POLICIES = ("none", "full")


def apply_recompute(model, policy: str = "none"):
    """Set which blocks of ``model`` recompute their activations; returns the model."""
    check_choice("recompute policy", policy, RECOMPUTE_POLICIES)
    model.recompute = [policy == "full"] * len(model.blocks)
    model.checkpoint_options = {}
    return model
