"""Where a verdict holds: the estimate swept over batch x sequence, and the edges found in it.

What a technique saves depends on the regime. While the optimizer step sets the peak (model
states plus AdamW's temporaries), nothing that shrinks activations can lower it; past the
crossover the saving grows with the tokens per device. Labs draw each verdict from such a sweep
(mixed precision in lab 02, recomputation in lab 03) and mark where the crossover falls.

    rows = sweep("llama-2-7b", {"full recompute": {"recompute": "full"}},
                 batches=(1, 8), seqs=(512, 4096), precision="bf16-mixed")
    peak_leaves_optimizer("llama-2-7b", precision="bf16-mixed")     # 5260 tokens
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from labkit.predict import estimate


@dataclass(frozen=True)
class Saving:
    """One regime: the peak per device with a change, against the baseline's at the same
    batch x seq. ``moment``: where the changed step's peak falls ("optimizer step",
    "backward: layer 31")."""

    label: str
    batch: int
    seq: int
    peak: int
    baseline_peak: int
    moment: str

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def saved(self) -> float:
        """The share of the baseline's peak saved (negative: the change costs memory)."""
        return 1 - self.peak / self.baseline_peak

    def saves(self, percent: int) -> bool:
        """At least ``percent`` % of the baseline's peak saved, decided in integers."""
        return 100 * self.peak <= (100 - percent) * self.baseline_peak


def saving(cfg, batch: int, seq: int, change: dict, baseline: dict | None = None,
           label: str = "", **step) -> Saving:
    """``change`` (estimate keywords, e.g. ``{"recompute": "full"}``) against ``baseline`` (the
    keywords it replaces, e.g. ``{"precision": "fp32"}``) at batch x seq; ``step``: what both
    share (precision, layout, ...), on CUDA's defaults unless ``device`` says otherwise."""
    base = {**step, **(baseline or {})}
    reference = estimate(cfg, batch, seq, **base)
    changed = estimate(cfg, batch, seq, **{**base, **change})
    return Saving(label or ", ".join(f"{k}={v}" for k, v in change.items()), batch, seq,
                  changed.total, reference.total, changed.details["peak moment"])


def sweep(cfg, changes: dict[str, dict], batches, seqs, baseline: dict | None = None,
          **step) -> list[Saving]:
    """``saving`` of each labelled change (``{label: estimate keywords}``) at every batch x seq."""
    return [saving(cfg, b, s, change, baseline, label, **step)
            for label, change in changes.items() for b in batches for s in seqs]


def first(holds: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The smallest n in (lo, hi] with ``holds(n)``, for a condition that stays true once true
    (a bisection: about log2(hi - lo) calls); None if it does not hold at ``hi``."""
    if not holds(hi):
        return None
    while hi - lo > 1:                      # holds(hi); not holds(lo), or lo is the bound
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds(mid) else (mid, hi)
    return hi


def peak_leaves_optimizer(cfg, batch: int = 1, multiple: int = 1, most: int = 2 ** 17,
                          **step) -> int | None:
    """The shortest sequence (a multiple of ``multiple``, up to ``most``) at which the step's peak
    is no longer the optimizer step: the crossover (``step``: estimate keywords)."""
    def past(k: int) -> bool:
        return estimate(cfg, batch, k * multiple, **step).peak_phase != "optimizer"
    k = first(past, 0, most // multiple)
    return None if k is None else k * multiple
