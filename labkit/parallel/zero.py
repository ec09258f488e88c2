"""ZeRO (Rajbhandari et al., 2020): partition the model states over the data-parallel ranks.

Stage 1 partitions the optimizer state, stage 2 the gradients too, stage 3 the parameters
too. This file holds the byte rule both the paper's formula (``labkit.papers``) and
``labkit.estimate`` use; lab 04 adds the mechanism itself.
"""
from __future__ import annotations

SHARDED_FROM_STAGE = {"params": 3, "grads": 2, "optimizer": 1}


def shard(n: int, dp: int) -> int:
    """One rank's share of ``n`` (bytes or elements) split over ``dp`` ranks: the ceiling,
    as a flat buffer padded to a multiple of ``dp`` gives every rank the same share."""
    return -(-n // dp)


def per_rank(n: int, state: str, zero_stage: int, dp: int) -> int:
    """What one rank holds of a model state (``params``, ``grads``, ``optimizer``) of ``n``."""
    return shard(n, dp) if zero_stage >= SHARDED_FROM_STAGE[state] else n
