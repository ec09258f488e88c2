"""One rank's training steps under the memory tracker: what every data-parallel lab measures.

Each rank trains on its own rows (``rank_tokens``) and measures the last, steady-state step
(the optimizer state exists by then): its peak bytes by category and the bytes it sent. The
wrappers (DDP, labkit's ZeRO, ZeroRedundancyOptimizer, FSDP2) build the model and the
optimizer; ``measure_rank`` runs the same loop for all of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from labkit.core.units import Breakdown
from labkit.training.step import train_step
from labkit.training.track import MemoryTracker


@dataclass
class RankStep:
    """One rank's steps: the loss of each, and the tracker's figures for the last one."""

    rank: int
    losses: list
    peak: int
    peak_by_category: dict
    peak_phase: str
    sent: dict = field(default_factory=dict)     # collective -> bytes this rank sent in the last step
    host_peak: int = 0                           # offloaded bytes in host memory, at their peak

    def breakdown(self) -> Breakdown:
        """The peak by category, as the estimate and the plots take it."""
        return Breakdown(**self.peak_by_category, peak_phase=self.peak_phase)


def rank_tokens(ctx, vocab: int, batch: int, seq: int, steps: int, seed: int = 0) -> list:
    """This rank's rows of each step's global batch: ``steps`` tensors (batch, seq + 1).

    The global batch of a step is ``world_size * batch`` rows drawn from one seed, so every
    world size trains on the same data: rank r takes rows [r * batch, (r + 1) * batch).
    """
    g = torch.Generator().manual_seed(seed)
    rows = slice(ctx.rank * batch, (ctx.rank + 1) * batch)
    return [torch.randint(0, vocab, (ctx.world_size * batch, seq + 1), generator=g)[rows]
            .to(ctx.device) for _ in range(steps)]


def measure_rank(ctx, model, forward, optimizer, batches: list, precision: str = "fp32",
                 states=None, sent=None) -> RankStep:
    """Train on ``batches`` with ``forward(tokens, targets) -> loss`` and ``optimizer``; the
    tracker measures the last step. ``model`` and ``states`` (an optimizer whose ``.state``
    holds the moments) name what to count as parameters, gradients and optimizer state;
    ``sent()`` returns the bytes sent in the last step, by collective."""
    losses = []
    with MemoryTracker(model, states or optimizer, timeline=False) as mt:
        for i, tokens in enumerate(batches):              # (batch, seq + 1)
            if i == len(batches) - 1:
                mt.tag_states()
                mt.reset_peak()                           # the steady-state step
            result = train_step(forward, optimizer, tokens[:, :-1], tokens[:, 1:], precision,
                                tracker=mt)
            losses.append(result.loss)
    return RankStep(ctx.rank, losses, mt.peak, dict(mt.peak_by_category), mt.peak_phase,
                    dict(sent()) if sent else {}, mt.host_peak)
