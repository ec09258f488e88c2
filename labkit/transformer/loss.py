"""The language-model loss a chunk of tokens at a time: no (tokens, vocab) logits in memory.

With DeepSeek-V3's 129,280-token vocabulary the LM head's fp32 logits, their log-softmax and
their gradient take N x V x 4 bytes each, often the step's peak. ``chunked_cross_entropy``
runs the head's matmul and the cross-entropy C tokens at a time, keeps one fp32 log-sum-exp
per token, and recomputes each chunk's logits in the backward pass, as Cut Cross-Entropy
(Wijmans et al., 2024) does, in plain PyTorch. Liger Kernel's fused linear cross-entropy (Hsu
et al., 2024) instead forms each chunk's gradients in the forward pass: no recomputation, but
the input's and the head's gradients are held from the forward pass on.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from labkit.core.units import check_positive
from labkit.transformer.grouped_mm import autocast_copies


def _chunk_logits(hidden, weight):
    """(C, h) @ (V, h)^T in the inputs' dtype, then fp32 for the softmax: (C, V) fp32."""
    return (hidden @ weight.t()).float()


def _chunk_loss(hidden, weight, targets, ignore_index):
    """One chunk's log-sum-exp of the logits, (C,) fp32, and its loss summed over the tokens
    that count: sum of lse - logit[target]."""
    logits = _chunk_logits(hidden, weight)                                       # (C, V)
    picked = logits.gather(1, targets.clamp(min=0)[:, None])[:, 0]               # (C,)
    top = logits.amax(dim=1)                                                     # (C,)
    # overwrite the chunk with exp(logits - top): no second (C, V) tensor
    lse = logits.sub_(top[:, None]).exp_().sum(dim=1).log_().add_(top)           # (C,)
    return lse, torch.where(targets != ignore_index, lse - picked, 0.0).sum()


def _chunk_grad_logits(hidden, weight, targets, lse, scale):
    """One chunk's d loss / d logits = (softmax - one_hot(target)) x scale: (C, V), in hidden's
    dtype. The softmax comes from the saved log-sum-exp, in place in the recomputed logits."""
    grad = _chunk_logits(hidden, weight).sub_(lse[:, None]).exp_()               # (C, V) fp32
    grad[torch.arange(len(targets), device=grad.device), targets.clamp(min=0)] -= 1.0
    return grad.mul_(scale[:, None]).to(hidden.dtype)


class ChunkedCrossEntropy(torch.autograd.Function):
    """Mean over tokens of -log softmax(hidden @ weight^T)[target], ``chunk`` tokens at a time.

    Forward keeps only its inputs and one fp32 log-sum-exp per token; backward recomputes
    each chunk's logits. One (chunk, V) fp32 tensor is alive at a time (and its bf16 original
    under autocast); each chunk's helper returns before the next starts.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, ignore_index: int):
        # hidden (N, h), weight (V, h), targets (N,)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)    # (N,)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            lse[s:s + chunk], loss = _chunk_loss(hidden[s:s + chunk], weight,
                                                 targets[s:s + chunk], ignore_index)
            total += loss
        count = (targets != ignore_index).sum()                  # tokens that count, as a tensor
        ctx.save_for_backward(hidden, weight, targets, lse, count)
        ctx.chunk, ctx.ignore_index = chunk, ignore_index
        return total / count

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        hidden, weight, targets, lse, count = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None                # (N, h)
        grad_weight = torch.zeros_like(weight) if want_weight else None                # (V, h)
        for s in range(0, hidden.shape[0], ctx.chunk):
            h, t = hidden[s:s + ctx.chunk], targets[s:s + ctx.chunk]                   # (C, h), (C,)
            scale = torch.where(t != ctx.ignore_index, grad_loss / count, 0.0)         # (C,)
            grad = _chunk_grad_logits(h, weight, t, lse[s:s + ctx.chunk], scale)       # (C, V)
            if want_hidden:
                torch.mm(grad, weight, out=grad_hidden[s:s + ctx.chunk])                # (C, h)
            if want_weight:
                grad_weight.addmm_(grad.t(), h)                                        # (V, h)
            del grad                          # before the next chunk's logits are made
        return grad_hidden, grad_weight, None, None, None


def chunked_cross_entropy(hidden, weight, targets, chunk: int, ignore_index: int = -100):
    """``F.cross_entropy(hidden @ weight.T, targets)`` (mean over the tokens not equal to
    ``ignore_index``) without the (N, V) logits: hidden (N, h), weight (V, h), targets (N,).

    Under autocast the matmuls take bf16 copies of hidden and weight, as ``F.linear`` would,
    and the softmax stays fp32, as the model's own ``logits.float()`` does.
    """
    check_positive("chunk", chunk)
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden (N, h) and weight (V, h) must share h, got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}; flatten (B, T, h) "
                         f"to (B*T, h) first")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be ({hidden.shape[0]},), one per row of hidden, got "
                         f"{tuple(targets.shape)}; flatten (B, T) targets to (B*T,)")
    hidden, weight = autocast_copies(hidden, weight)                 # (N, h), (V, h)
    return ChunkedCrossEntropy.apply(hidden, weight, targets, chunk, ignore_index)


# ---- what the loss alone costs: tracked bytes, full logits vs chunks -------------------------
@dataclass
class LossPeak:
    """Most bytes alive beyond the inputs (hidden, LM head weight, targets), in each pass of
    the loss alone; the backward figure includes the gradients it makes."""

    forward: int
    backward: int
    loss: float | None           # None on fake tensors


def measure_loss(tokens: int, hidden: int, vocab: int, chunk: int | None = None,
                 autocast: bool = False, fake: bool = True, seed: int = 0) -> LossPeak:
    """LM head + cross-entropy on random (tokens, hidden) inputs under ``labkit.MemoryTracker``:
    ``chunk`` None as the model computes it (full logits, ``.float()``), else chunked. On fake
    tensors by default: real shapes and bytes, no memory used."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from labkit.training.track import MemoryTracker

    torch.manual_seed(seed)
    with FakeTensorMode() if fake else contextlib.nullcontext(), MemoryTracker() as mt:
        h = torch.randn(tokens, hidden, requires_grad=True)                     # (N, h)
        w = (torch.randn(vocab, hidden) * 0.02).requires_grad_()                # (V, h)
        targets = torch.randint(0, vocab, (tokens,))                             # (N,)
        inputs = mt.current
        mt.reset_peak()
        with mt.phase("forward"), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            if chunk is None:                  # the model's own path: the logits, then fp32
                logits = F.linear(h, w)                                          # (N, V)
                loss = F.cross_entropy(logits.float(), targets)
                del logits
            else:
                loss = chunked_cross_entropy(h, w, targets, chunk)
        forward = mt.peak - inputs
        with mt.phase("backward"):
            loss.backward()
    return LossPeak(forward, mt.peak - inputs, None if fake else loss.item())
