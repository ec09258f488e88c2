"""One training step with the options every lab toggles: precision and optimizer (recompute is
the model's: ``labkit.transformer.checkpointing``). Training runs of whole models:
``labkit.training.train``.

Precisions (what is stored, what is computed; their bytes: ``labkit.core.recipe``):

- ``fp32``: fp32 weights, gradients, optimizer state and activations.
- ``bf16``: everything in bf16 ("pure bf16"; the optimizer state too).
- ``bf16-master``: bf16 weights, gradients and activations; the optimizer keeps fp32 master
  weights and fp32 moments (the mixed precision of Micikevicius et al. and the ZeRO paper).
  ``fp16-master`` has the same bytes and is estimated only.
- ``bf16-mixed``: fp32 weights, gradients and state; matmuls in bf16 under
  ``torch.autocast`` (PyTorch AMP). Autocast keeps bf16 copies of the weights for the
  backward pass: the "autocast weight cache" category.
- ``fp16-mixed``: as bf16-mixed in fp16, with a loss scaler (``torch.amp.GradScaler``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor

from labkit.core.recipe import (DEVICES, OPTIMIZER_IMPLS, OPTIMIZERS, PRECISIONS,  # noqa: F401
                                default_optimizer_impl)
from labkit.core.units import check_choice
from labkit.quantisation.optim8bit import AdamW8bit
from labkit.training.in_backward import OptimizerInBackward


def device() -> torch.device:
    """The device every lab uses: the GPU when CUDA is present, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def param_dtype(precision: str) -> torch.dtype:
    """The dtype the weights are stored in."""
    check_choice("precision", precision, PRECISIONS)
    if precision == "fp16-master":
        raise ValueError("fp16-master is estimated, not run: its bytes are bf16-master's; "
                         "measure precision='bf16-master'")
    return torch.bfloat16 if precision in ("bf16", "bf16-master") else torch.float32


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype autocast computes in, or None when autocast is off."""
    return {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(precision)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same storage), any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t    # torch.distributed not imported


class MasterWeights:
    """An optimizer over fp32 master copies of low-precision weights (Micikevicius et al., 2018).

    Each step turns the bf16 gradients into fp32 ones (freeing each bf16 gradient as it goes),
    steps the fp32 masters, and copies them back into the bf16 weights, so small updates are
    not rounded away. The masters count as optimizer state: 4 bytes per trained parameter. A sharded
    weight (FSDP2's DTensor) gets a plain master of its local shard, as Megatron's distributed
    optimizer keeps one: the same bytes and kernels, without DTensor's per-op dispatch.
    """

    def __init__(self, params, make_inner):
        self.params = [p for p in params if p.requires_grad]     # a frozen weight needs none
        self.masters = [_local(p.detach()).float().requires_grad_(True) for p in self.params]
        self.inner = make_inner(self.masters)
        self.param_groups = self.inner.param_groups

    @property
    def state(self) -> dict:
        """Per weight: its fp32 master and the inner optimizer's state for it."""
        return {p: {"master": m, **self.inner.state.get(m, {})}
                for p, m in zip(self.params, self.masters)}

    def step(self):
        for p, master in zip(self.params, self.masters):
            master.grad = None if p.grad is None else _local(p.grad).float()
            p.grad = None
        self.inner.step()
        with torch.no_grad():
            for p, master in zip(self.params, self.masters):
                _local(p).copy_(master)

    def zero_grad(self, set_to_none: bool = True):
        for p, master in zip(self.params, self.masters):
            p.grad = master.grad = None

    def memory_tags(self) -> list:
        """What the inner optimizer tags for the tracker itself (AdamW8bit: its maps)."""
        return list(getattr(self.inner, "memory_tags", list)())


def make_optimizer(params, optimizer: str = "adamw", impl: str | None = None, lr: float = 1e-3,
                   device: str | torch.device = "cpu", master_weights: bool = False,
                   in_backward: bool = False):
    """A torch optimizer by the course's names; ``impl`` picks AdamW's implementation;
    ``master_weights`` wraps it in ``MasterWeights``; ``in_backward`` steps each parameter in
    the backward pass (``OptimizerInBackward``)."""
    if in_backward:
        if master_weights:
            raise ValueError("labkit's master weights copy every gradient at the step; with "
                             "in_backward use precision 'bf16' or 'bf16-mixed'")
        return OptimizerInBackward(params, lambda one: make_optimizer(one, optimizer, impl, lr,
                                                                       device))
    if master_weights:
        return MasterWeights(params, lambda masters: make_optimizer(masters, optimizer, impl,
                                                                     lr, device))
    check_choice("optimizer", optimizer, OPTIMIZERS)
    impl = impl or default_optimizer_impl(device)
    check_choice("optimizer implementation", impl, OPTIMIZER_IMPLS)
    flags = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True),
             "fused": dict(fused=True)}[impl]
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, **flags)
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, **flags)
    if optimizer == "sgd-momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, **flags)
    return AdamW8bit(params, lr=lr, weight_decay=0.1)   # "adamw-8bit": labkit's blockwise 8-bit


@dataclass
class StepResult:
    loss: float | None          # None on fake tensors
    grad_norm: float | None = None  # with clip_norm: the unscaled norm before clipping


def train_step(model, optimizer, tokens, targets, precision: str = "fp32", scaler=None,
               tracker=None, loss_factor: float = 1.0, offload: bool = False,
               clip_norm: float | None = None, autocast_cache: bool = True) -> StepResult:
    """forward -> backward -> optimizer step -> zero_grad(set_to_none), phases on ``tracker``.

    ``loss_factor`` multiplies the loss before backward (lab 02 shrinks gradients with it);
    the loss reported is the model's own. ``offload`` keeps what autograd saves in pinned
    CPU memory (``torch.autograd.graph.save_on_cpu``): GPU memory for PCIe traffic.
    ``clip_norm`` clips the gradients' global norm, after ``scaler.unscale_`` so that the
    norm compared is the true one, not scale x it. ``autocast_cache``: torch.autocast's
    ``cache_enabled``.
    """
    if clip_norm is not None and not clip_norm > 0:
        raise ValueError(f"clip_norm must be a positive number, got {clip_norm!r}; use e.g. 1.0, "
                         "or None for no clipping")
    if isinstance(optimizer, OptimizerInBackward) and (clip_norm is not None or scaler is not None):
        raise ValueError("the optimizer steps in backward: no moment holds every gradient to "
                         "clip by their global norm or check for inf (loss scaling); pass "
                         "clip_norm=None and scaler=None, or an ordinary optimizer")
    phase = tracker.phase if tracker is not None else (lambda name: contextlib.nullcontext())
    dtype = autocast_dtype(precision)
    autocast = (torch.autocast(tokens.device.type, dtype=dtype, cache_enabled=autocast_cache)
                if dtype is not None else contextlib.nullcontext())
    saving = (torch.autograd.graph.save_on_cpu(pin_memory=tokens.device.type == "cuda")
              if offload else contextlib.nullcontext())
    with saving:
        with phase("forward"), autocast:
            loss = model(tokens, targets)
        with phase("backward"):
            scaled = loss * loss_factor if loss_factor != 1.0 else loss
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
    norm = None
    with phase("optimizer"):
        if clip_norm is not None:
            if scaler is not None:
                scaler.unscale_(optimizer)          # clip the true gradients, not scaled ones
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    fake = isinstance(loss, FakeTensor)
    return StepResult(None if fake else loss.item(), None if fake or norm is None else norm.item())


def bigram_corpus(vocab_size: int, n_tokens: int, seed: int = 0, branching: int = 4) -> torch.Tensor:
    """A seeded token stream where each token is followed by one of ``branching`` successors:
    learnable in a few dozen steps, its best loss is ln(branching)."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab_size, (vocab_size, branching), generator=g)
    choice = torch.randint(0, branching, (n_tokens,), generator=g)
    tokens = torch.empty(n_tokens, dtype=torch.long)
    tokens[0] = 0
    for i in range(1, n_tokens):
        tokens[i] = successors[tokens[i - 1], choice[i]]
    return tokens
