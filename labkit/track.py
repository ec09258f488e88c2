"""Count the bytes of every live tensor storage, by category, on CPU, CUDA and fake tensors.

``MemoryTracker`` is a ``TorchDispatchMode``: every operator's outputs pass through it, and
each new storage is counted once (views and in-place results share their storage) until
Python frees it (``weakref.finalize``). On CPU and fake tensors this is exact and repeatable;
on CUDA it equals what the caching allocator hands out before its rounding to 512-byte
blocks, so ``torch.cuda.max_memory_allocated`` reads slightly higher.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .units import Breakdown

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "other")
"""What a byte is, at the moment it is counted:

- parameters: the model's weights (and any copy registered as such);
- gradients: ``.grad`` of a parameter, from the moment autograd accumulates it;
- optimizer: tensors in ``optimizer.state`` (AdamW's moments, SGD's momentum);
- activations: tensors made in the forward phase and still alive - what autograd saved
  for the backward pass, the loss, the logits;
- other: everything else - gradients of activations in flight during backward, the
  optimizer's temporaries, activations recomputed by checkpointing, buffers (RoPE tables).
"""

# Tensors made in each phase start in this category (gradients and states are re-tagged).
_PHASE_CATEGORY = {"forward": "activations"}


@dataclass
class Timeline:
    """Live bytes per category after each allocation or free, with the phase it happened in."""

    phase: list = field(default_factory=list)
    by_category: dict = field(default_factory=lambda: {c: [] for c in CATEGORIES})

    def __len__(self):
        return len(self.phase)

    @property
    def total(self) -> list[int]:
        return [sum(v) for v in zip(*self.by_category.values())]

    def phase_spans(self) -> list[tuple[str, int, int]]:
        """(phase, first event, last event + 1) for each contiguous run of one phase."""
        spans, start = [], 0
        for i in range(1, len(self.phase) + 1):
            if i == len(self.phase) or self.phase[i] != self.phase[start]:
                spans.append((self.phase[start], start, i))
                start = i
        return spans


class MemoryTracker(TorchDispatchMode):
    """Live and peak bytes of tensor storages, by category, with a timeline.

    Pass the ``model`` and ``optimizer`` to count what exists before tracking starts
    (weights, buffers, optimizer state) and to tag gradients and optimizer state as they
    appear. Mark phases with ``with mt.phase("forward"): ...``.

        with lk.MemoryTracker(model, opt) as mt:
            with mt.phase("forward"):
                loss = model(x, y)
        mt.peak, mt.peak_by_category, mt.timeline
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, timeline: bool = True):
        super().__init__()
        self.model, self.optimizer, self.record_timeline = model, optimizer, timeline
        self._live: dict[int, list] = {}           # storage id -> [nbytes, category]
        self._bytes = dict.fromkeys(CATEGORIES, 0)
        self.current = 0
        self.peak = 0
        self.peak_by_category = dict(self._bytes)
        self.peak_phase = None
        self._phase = "setup"
        self.timeline = Timeline()
        self._hooks = []

    # ---- bookkeeping -----------------------------------------------------------------
    def _add(self, storage, category):
        key = storage._cdata
        if key in self._live:
            return
        nbytes = storage.nbytes()
        self._live[key] = [nbytes, category]
        weakref.finalize(storage, self._free, key)
        self._bytes[category] += nbytes
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current
            self.peak_by_category = dict(self._bytes)
            self.peak_phase = self._phase
        self._record()

    def _free(self, key):
        entry = self._live.pop(key, None)
        if entry is None:
            return
        self._bytes[entry[1]] -= entry[0]
        self.current -= entry[0]
        self._record()

    def _record(self):
        if self.record_timeline:
            self.timeline.phase.append(self._phase)
            for category, series in self.timeline.by_category.items():
                series.append(self._bytes[category])

    def tag(self, tensor: torch.Tensor, category: str):
        """Count ``tensor``'s storage under ``category`` (moving it there if already counted)."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown category {category!r}; use one of {CATEGORIES}")
        storage = tensor.untyped_storage()
        entry = self._live.get(storage._cdata)
        if entry is None:
            self._add(storage, category)
        elif entry[1] != category:
            self._bytes[entry[1]] -= entry[0]
            self._bytes[category] += entry[0]
            entry[1] = category

    def tag_states(self):
        """Tag the model's weights, buffers and gradients and the optimizer's state."""
        if self.model is not None:
            for p in self.model.parameters():
                self.tag(p, "parameters")
                if p.grad is not None:
                    self.tag(p.grad, "gradients")
            for b in self.model.buffers():
                self.tag(b, "other")
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        self.tag(value, "optimizer")

    # ---- phases ----------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str):
        """Label the events inside the block (``forward``, ``backward``, ``optimizer``, ...)."""
        previous, self._phase = self._phase, name
        try:
            yield self
        finally:
            self._phase = previous
            if name == "optimizer":
                self.tag_states()           # the first step creates the optimizer state

    def reset_peak(self):
        """Start a new peak from the bytes live now (and a new timeline)."""
        self.peak, self.peak_by_category = self.current, dict(self._bytes)
        self.peak_phase = self._phase
        self.timeline = Timeline()
        self._record()

    @property
    def by_category(self) -> dict[str, int]:
        """Live bytes per category now."""
        return dict(self._bytes)

    # ---- the mode --------------------------------------------------------------------
    def __enter__(self):
        self.tag_states()
        if self.model is not None:
            for p in self.model.parameters():
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(
                        lambda p: self.tag(p.grad, "gradients")))
        self.reset_peak()
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        category = _PHASE_CATEGORY.get(self._phase, "other")
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage(), category)
        return out


# ---- one measured training step ----------------------------------------------------------
@dataclass
class Measurement(Breakdown):
    """A ``Breakdown`` measured by the tracker, with its timeline and the device it ran on."""

    timeline: Timeline = field(default_factory=Timeline)
    device: str = "cpu"
    fake: bool = False
    cuda_peak: int | None = None     # torch.cuda.max_memory_allocated for the same step
    loss: float | None = None


def init_optimizer_state(model, optimizer):
    """Allocate the optimizer's state with one step on zero gradients (no forward pass needed)."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure_step(cfg, batch: int = 1, seq: int = 2048, precision: str = "bf16-mixed",
                 optimizer: str = "adamw", recompute: str = "none", fake: bool = True,
                 device=None, optimizer_impl: str | None = None, warmup: bool = True,
                 seed: int = 0) -> Measurement:
    """Run one training step of ``labkit.model`` under the tracker; bytes at its peak.

    ``warmup`` creates the optimizer state first, so that the measured step is a steady-state
    one (the first step's peak is lower: its state is born inside ``optimizer.step()``). ``fake=True`` measures full-size models on fake tensors:
    shapes and bytes are real, no memory is used, and MoE routing is assumed balanced.
    """
    from .config import preset
    from .checkpointing import apply_recompute
    from .model import build_model
    from .train import make_optimizer, param_dtype, train_step

    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    if batch <= 0 or seq <= 0:
        raise ValueError(f"batch and seq must be positive, got batch={batch}, seq={seq}")
    if seq > cfg.max_seq:
        raise ValueError(f"seq={seq} exceeds the model's max_seq={cfg.max_seq}; "
                         f"use cfg.replace(max_seq={seq})")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() and not fake else "cpu"))
    torch.manual_seed(seed)
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    with mode:
        model = apply_recompute(build_model(cfg, param_dtype(precision), device), recompute)
        opt = make_optimizer(model.parameters(), optimizer, optimizer_impl, device=device,
                             master_weights=precision == "bf16-master")
        scaler = (torch.amp.GradScaler(device.type) if precision == "fp16-mixed" and not fake
                  else None)
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]                     # (B, T) each
        if warmup:
            init_optimizer_state(model, opt)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with MemoryTracker(model, opt) as mt:
            result = train_step(model, opt, inputs, targets, precision, scaler, tracker=mt)
    forward_end = [i for i, p in enumerate(mt.timeline.phase) if p == "forward"]
    saved = mt.timeline.by_category["activations"][forward_end[-1]] if forward_end else 0
    peak = mt.peak_by_category
    return Measurement(
        params=peak["parameters"], grads=peak["gradients"], optimizer=peak["optimizer"],
        activations=peak["activations"], other=peak["other"], peak_phase=mt.peak_phase,
        saved_activations=saved, timeline=mt.timeline, device=device.type, fake=fake,
        cuda_peak=torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
        loss=result.loss)


def activations_per_module(model, tokens, targets, modules) -> dict[str, int]:
    """Bytes each named module adds to what the forward pass keeps alive (its saved activations).

    The tracker's live bytes are read before and after each module's forward: what stays is
    what autograd saved for the backward pass, plus the module's output.
    """
    kept, before, handles = {}, {}, []
    with MemoryTracker(model) as mt:
        for name, module in modules.items():
            handles.append(module.register_forward_pre_hook(
                lambda m, args, name=name: before.__setitem__(name, mt.current)))
            handles.append(module.register_forward_hook(
                lambda m, args, out, name=name: kept.__setitem__(name, mt.current - before[name])))
        try:
            with mt.phase("forward"):
                loss = model(tokens, targets)
        finally:
            for h in handles:
                h.remove()
    del loss
    return kept
