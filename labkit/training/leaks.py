"""Everyday leaks: habits of a training script that keep each step's tensors or autograd graph
alive, so memory grows step after step until an out-of-memory error hours into a run (lab 08).

Each habit runs a few steps of a real model (CPU, real tensors) beside its fix and is counted two
ways: the bytes of tensor storage it keeps (``MemoryTracker``: on a GPU, what
``torch.cuda.memory_allocated()`` would show) and the autograd nodes reachable from what it keeps
(host memory, which no tensor tracker sees). ``host_growth`` measures those host bytes.

=============================  ========================================  ==========================
habit                          what one step keeps                       fix
=============================  ========================================  ==========================
eval loss as a tensor          the graph and all its forward saved       ``torch.no_grad()``, ``.item()``
eval, autocast per batch       that, plus bf16 copies of matmul weights  the same
eval, autocast around loop     that, the copies made once for the loop   the same
outputs kept                   a (B, T, vocab) logits tensor + graph     a number (``.item()``)
outputs kept, detached         the same logits, no graph                 a reduced tensor
hook keeps activations         a (B, T, hidden) tensor + graph           a statistic (``.item()``)
train loss as a tensor         the graph's nodes (backward freed the     ``total += loss.item()``
                               saved tensors): host memory only
=============================  ========================================  ==========================

Autocast's cast cache lives until the outermost ``torch.autocast`` block exits; a graph that
outlives it keeps the copies it saved, so entering autocast per batch makes each leaked batch keep
its own. ``backward`` frees what ops saved with ``save_for_backward``; a custom
``autograd.Function`` that stores a tensor as a ``ctx`` attribute keeps it as long as the graph.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import os
from dataclasses import dataclass

import torch

from labkit.core.config import ModelConfig, preset
from labkit.core.units import check_choice, check_positive
from labkit.training.step import make_optimizer
from labkit.training.track import MemoryTracker
from labkit.transformer.model import build_model

EVAL = ("eval loss as a tensor", "eval, autocast per batch", "eval, autocast around loop")
LEAKS = EVAL + ("outputs kept", "outputs kept, detached", "hook keeps activations",
                "train loss as a tensor")


@dataclass
class LeakRun:
    """One habit (or its fix) over ``steps`` steps. ``after_step``: bytes of tensor storage live
    after each step beyond those live before the first (the model, its inputs and AdamW's state
    are made before: an untracked warm-up step creates the state); ``nodes``: autograd nodes
    reachable from what the loop kept, after each step; ``peak``: the highest bytes, beyond the
    same start."""

    leak: str
    fixed: bool
    after_step: list[int]
    nodes: list[int]
    peak: int

    @property
    def per_step(self) -> int:
        """The bytes one more step keeps."""
        return self.after_step[-1] - self.after_step[-2]

    @property
    def nodes_per_step(self) -> int:
        """The autograd nodes one more step keeps."""
        return self.nodes[-1] - self.nodes[-2]


def graph_nodes(kept) -> int:
    """Autograd nodes reachable from the tensors in ``kept`` (a tensor, or a list of tensors and
    numbers): each one's ``grad_fn`` and, through ``next_functions``, every node behind it,
    counted once (the parameters' ``AccumulateGrad`` nodes included)."""
    kept = kept if isinstance(kept, (list, tuple)) else [kept]
    stack = [t.grad_fn for t in kept if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(f for f, _ in node.next_functions if f is not None)
    return len(seen)


def _bf16(on: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if on else contextlib.nullcontext()


def _step(leak: str, model, opt, x, y, fixed: bool, kept: list) -> None:
    """One step of ``leak`` (or of its fix); what the loop keeps goes into ``kept`` (``kept[0]``
    is the running total of the loss habits)."""
    if leak in EVAL:                                      # an evaluation batch: no backward
        with _bf16(leak == "eval, autocast per batch"):
            if fixed:
                with torch.no_grad():
                    kept[0] += model(x, y).item()
            else:
                kept[0] = kept[0] + model(x, y)           # a tensor: its graph stays
        return
    if leak.startswith("outputs kept"):
        logits = model(x)                                                     # (B, T, vocab)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        if fixed:                                         # a number
            kept.append(logits.argmax(-1).eq(y).float().mean().item())
        else:                                             # on CPU .cpu() is the same tensor
            kept.append(logits.detach().cpu() if leak.endswith("detached") else logits)
    else:                                 # the hook (set in run_leak) keeps what it keeps
        loss = model(x, y)
        loss.backward()
        if leak == "train loss as a tensor":
            kept[0] = kept[0] + (loss.item() if fixed else loss)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _setup(leak: str, cfg: ModelConfig | str, batch: int, seq: int, seed: int):
    """The model, an optimizer whose state exists (one plain step made it), the batch."""
    check_choice("leak", leak, LEAKS)
    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    torch.manual_seed(seed)
    model = build_model(cfg)
    opt = make_optimizer(model.parameters(), "adamw", "for-loop")
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    if leak not in EVAL:
        _step("train loss as a tensor", model, opt, x, y, True, [0.0])     # AdamW's state
    return model, opt, x, y


@contextlib.contextmanager
def _habit(leak: str, model, fixed: bool, kept: list):
    """What stays on for the whole loop: the hook of "hook keeps activations", removed after
    (removing it frees nothing ``kept`` holds); autocast around the loop."""
    handle = None
    if leak == "hook keeps activations":
        keep = ((lambda m, i, out: kept.append(out.norm().item())) if fixed
                else (lambda m, i, out: kept.append(out)))                   # (B, T, hidden)
        handle = model.blocks[-1].register_forward_hook(keep)
    try:
        with _bf16(leak == "eval, autocast around loop"):
            yield
    finally:
        if handle is not None:
            handle.remove()


def run_leak(leak: str, fixed: bool = False, steps: int = 4, cfg: ModelConfig | str = "tiny",
             batch: int = 2, seq: int = 64, seed: int = 0) -> LeakRun:
    """``steps`` steps of ``leak`` (or of its fix) on ``cfg``'s model, real CPU tensors in fp32
    (bf16 autocast for the autocast habits): bytes and graph nodes kept after each step."""
    check_positive("steps", steps)
    if steps < 2:
        raise ValueError(f"steps={steps}: a leak shows over two steps or more; use steps=4")
    model, opt, x, y = _setup(leak, cfg, batch, seq, seed)
    kept, after, nodes = [0.0], [], []
    with MemoryTracker(model, opt, timeline=False) as mt:
        start = mt.current
        with _habit(leak, model, fixed, kept):
            for _ in range(steps):
                _step(leak, model, opt, x, y, fixed, kept)
                after.append(mt.current - start)
                nodes.append(graph_nodes(kept))
        peak = mt.peak - start
    return LeakRun(leak, fixed, after, nodes, peak)


def leak_table(steps: int = 4, cfg: ModelConfig | str = "tiny", batch: int = 2,
               seq: int = 64) -> list[tuple[LeakRun, LeakRun]]:
    """Each leak beside its fix: [(leaking, fixed), ...] in ``LEAKS`` order."""
    return [(run_leak(k, False, steps, cfg, batch, seq), run_leak(k, True, steps, cfg, batch, seq))
            for k in LEAKS]


# ---- what a step keeps, by formula -----------------------------------------------------------
def kept_per_step(leak: str, cfg: ModelConfig | str, batch: int, seq: int) -> int:
    """The bytes of tensor storage one step of ``leak`` keeps, by formula, in ``run_leak``'s
    regime (fp32; bf16 autocast for the autocast habits). The eval habits keep what the forward
    saved: ``lk.estimate``'s saved activations, which count the (B, T + 1) int64 token batch
    (here made once, before the loop) where this loop keeps the (B x T) int64 targets that
    cross-entropy copies from the shifted slice: 8 x B bytes fewer."""
    from labkit.predict import estimate

    check_choice("leak", leak, LEAKS)
    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    if leak in EVAL:
        est = estimate(cfg, batch, seq, precision="fp32" if leak == EVAL[0] else "bf16-mixed",
                       device="cpu")
        copies = est.saved_weight_cache if leak == "eval, autocast per batch" else 0
        return est.saved_activations - 8 * batch * (seq + 1) + 8 * batch * seq + copies
    if leak.startswith("outputs kept"):
        return batch * seq * cfg.vocab_size * 4                  # fp32 logits
    if leak == "hook keeps activations":
        return batch * seq * cfg.hidden * 4                      # the block's fp32 output
    return 0                                                     # backward freed the saved tensors


def nodes_per_step(cfg: ModelConfig | str) -> int:
    """The autograd nodes one step of "train loss as a tensor" keeps: the nodes of one training
    step's graph but the parameters' ``AccumulateGrad`` (shared by every step), plus the add.
    Counted on a forward over fake tensors, so it works for any size of model."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    with FakeTensorMode():
        model = build_model(cfg)
        tokens = torch.randint(0, cfg.vocab_size, (1, 9))
        loss = model(tokens[:, :-1], tokens[:, 1:])
    shared = sum(1 for p in model.parameters() if p.requires_grad)
    return graph_nodes(loss) - shared + 1


# ---- host memory: what the graph's nodes take --------------------------------------------------
@dataclass
class HostGrowth:
    """Host memory one step adds, averaged over ``steps`` steps: ``malloc`` is what the C
    allocator has handed out and not got back (glibc's ``mallinfo2``; None elsewhere), ``rss`` the
    resident set (/proc/self/statm), which grows only once the heap's free space is used up."""

    leak: str
    fixed: bool
    steps: int
    malloc: float | None
    rss: float


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def _malloc_in_use() -> int | None:
    """Bytes glibc's malloc has handed out (heap and mmap), or None without glibc 2.33+."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def host_growth(leak: str = "train loss as a tensor", fixed: bool = False, steps: int = 200,
                cfg: ModelConfig | str = "tiny", batch: int = 2, seq: int = 64,
                warmup: int = 10, seed: int = 0) -> HostGrowth:
    """Host memory per step of ``leak`` (or its fix), untracked, after ``warmup`` steps. Linux
    only (it reads /proc); times and bytes vary a little with the machine and the torch build."""
    check_positive("steps", steps)
    model, opt, x, y = _setup(leak, cfg, batch, seq, seed)
    kept = [0.0]
    with _habit(leak, model, fixed, kept):
        for _ in range(warmup):
            _step(leak, model, opt, x, y, fixed, kept)
        gc.collect()
        rss, used = _rss(), _malloc_in_use()
        for _ in range(steps):
            _step(leak, model, opt, x, y, fixed, kept)
        gc.collect()
        rss, after = _rss() - rss, _malloc_in_use()
    return HostGrowth(leak, fixed, steps, None if used is None else (after - used) / steps,
                      rss / steps)
