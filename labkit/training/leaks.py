"""Everyday leaks: habits of a training script that keep each step's tensors alive, so memory
grows step after step until an out-of-memory error hours into a run. Each runs a few steps of a
real model under the ``MemoryTracker``, beside its fix (lab 08).

- ``"eval loss as a tensor"``: an evaluation loop without ``torch.no_grad()`` that sums its
  losses as tensors keeps every batch's autograd graph, with all it saved for a backward pass
  that never comes. Fix: ``torch.no_grad()`` (and ``.item()``).
- ``"outputs kept"``: logits appended to a list for logging keep a (B, T, vocab) tensor a step.
  Fix: keep a number (``.item()``), or ``.detach().cpu()`` what you must keep.
- ``"hook keeps activations"``: a forward hook that appends a block's output (to inspect it)
  keeps a (B, T, hidden) tensor a step, and while the graph lives all it references. Fix: keep a
  statistic, or remove the hook (``handle.remove()``).
- ``"train loss as a tensor"``: PyTorch's FAQ example, ``total_loss += loss`` in the training
  loop: ``backward`` has freed what the graph saved, so the device keeps only each step's
  4-byte loss, but the graph's nodes pile up in host memory. Fix: ``total_loss += loss.item()``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit.core.config import ModelConfig, preset
from labkit.core.units import check_choice, check_positive
from labkit.training.step import make_optimizer, train_step
from labkit.training.track import MemoryTracker
from labkit.transformer.model import build_model

LEAKS = ("eval loss as a tensor", "outputs kept", "hook keeps activations", "train loss as a tensor")


@dataclass
class LeakRun:
    """Bytes live after each step, beyond those live before the first (model and optimizer
    state included in neither), and the peak over all steps."""

    leak: str
    fixed: bool
    after_step: list[int]
    peak: int

    @property
    def per_step(self) -> int:
        """What one more step adds, once the optimizer's state exists (steps 2 onwards)."""
        return self.after_step[-1] - self.after_step[-2]


def _evaluate(model, tokens, targets, fixed: bool, kept: list) -> None:
    """One evaluation batch: the loss summed into ``kept[0]``."""
    if fixed:
        with torch.no_grad():
            kept[0] += model(tokens, targets).item()
    else:
        kept[0] = kept[0] + model(tokens, targets)        # a tensor: its graph stays


def _train(model, opt, tokens, targets, leak: str, fixed: bool, kept: list) -> None:
    """One training step, keeping what ``leak`` keeps (or its fix)."""
    if leak == "outputs kept":
        logits = model(tokens)                                         # (B, T, vocab)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        kept.append(logits.argmax(-1).eq(targets).float().mean().item() if fixed else logits)
    else:
        loss = model(tokens, targets)
        loss.backward()
        if leak == "train loss as a tensor":
            kept[0] = kept[0] + (loss.item() if fixed else loss)
    opt.step()
    opt.zero_grad(set_to_none=True)


def run_leak(leak: str, fixed: bool = False, steps: int = 4, cfg: ModelConfig | str = "tiny",
             batch: int = 2, seq: int = 64, seed: int = 0) -> LeakRun:
    """``steps`` steps of ``leak`` (or of its fix) on ``cfg``'s model, real CPU tensors in fp32:
    the bytes live after each step beyond those before the first, and the peak."""
    check_choice("leak", leak, LEAKS)
    check_positive("steps", steps)
    if steps < 2:
        raise ValueError(f"steps={steps}: a leak shows over two steps or more; use steps=4")
    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    torch.manual_seed(seed)
    model = build_model(cfg)
    opt = make_optimizer(model.parameters(), "adamw", "for-loop")
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    kept, handle = [0.0], None
    if leak == "hook keeps activations":
        keep = (lambda m, i, out: kept.append(out.norm().item())) if fixed else \
               (lambda m, i, out: kept.append(out))
        handle = model.blocks[-1].register_forward_hook(keep)
    after = []
    try:
        with MemoryTracker(model, opt, timeline=False) as mt:
            start = mt.current
            for _ in range(steps):
                if leak == "eval loss as a tensor":
                    _evaluate(model, x, y, fixed, kept)
                else:
                    _train(model, opt, x, y, leak, fixed, kept)
                after.append(mt.current - start)
            peak = mt.peak - start
    finally:
        if handle is not None:
            handle.remove()
    return LeakRun(leak, fixed, after, peak)


def leak_table(steps: int = 4, cfg: ModelConfig | str = "tiny", batch: int = 2,
               seq: int = 64) -> list[tuple[LeakRun, LeakRun]]:
    """Each leak beside its fix: [(leaking, fixed), ...] in ``LEAKS`` order."""
    return [(run_leak(k, False, steps, cfg, batch, seq), run_leak(k, True, steps, cfg, batch, seq))
            for k in LEAKS]
