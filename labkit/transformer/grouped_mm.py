"""Every expert's matmul in one op: a grouped matmul as a custom op, with its backward.

Tokens sorted by expert form contiguous groups of rows; group g is multiplied by weight g of a
stacked (G, out, in) tensor. One output tensor is written in place and, in the backward pass,
one (G, out, in) weight gradient - what a grouped GEMM kernel does. A custom op rather than
torch._grouped_mm: in torch 2.13 that one runs on CPU, but on fake tensors it accepts bf16
only, autocast leaves it in fp32, and it wants 16-byte-aligned strides. On fake tensors this
op runs once per call, not once per expert.
"""
from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula


def autocast_copies(*tensors):
    """The tensors as autocast hands them to a matmul: copies in its dtype while it is on (the
    copies autograd then saves), else themselves. For ops autocast does not know (custom ones)."""
    where = tensors[0].device.type
    if not torch.is_autocast_enabled(where):
        return tensors
    dtype = torch.get_autocast_dtype(where)
    return tuple(t.to(dtype) for t in tensors)


@torch.library.custom_op("labkit::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """(N, in) rows sorted by group, (G, out, in) weights -> (N, out): group g's rows @ w[g]^T."""
    y = x.new_empty(x.shape[0], w.shape[1])                                   # (N, out)
    for xg, yg, wg in zip(x.split(counts), y.split(counts), w):            # views, no copies
        torch.mm(xg, wg.t(), out=yg)                                          # (n_g, out)
    return y


@torch.library.custom_op("labkit::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(grad_y: torch.Tensor, x: torch.Tensor,
                           counts: list[int]) -> torch.Tensor:
    """d loss / d w of ``grouped_mm``: (G, out, in), slice g = grad_y[group g]^T @ x[group g]."""
    grad_w = x.new_empty(len(counts), grad_y.shape[1], x.shape[1])            # (G, out, in)
    for gy, xg, gw in zip(grad_y.split(counts), x.split(counts), grad_w):
        torch.mm(gy.t(), xg, out=gw)                                          # zeros if n_g = 0
    return grad_w


@grouped_mm.register_fake
def _(x, w, counts):
    return x.new_empty(x.shape[0], w.shape[1])


@grouped_mm_weight_grad.register_fake
def _(grad_y, x, counts):
    return x.new_empty(len(counts), grad_y.shape[1], x.shape[1])


def _grouped_mm_setup(ctx, inputs, output):
    x, w, counts = inputs
    ctx.save_for_backward(x, w)                                               # as F.linear saves
    ctx.counts = counts


def _grouped_mm_backward(ctx, grad_y):
    x, w = ctx.saved_tensors
    grad_x = grouped_mm(grad_y, w.transpose(1, 2), ctx.counts) if ctx.needs_input_grad[0] else None
    grad_w = grouped_mm_weight_grad(grad_y, x, ctx.counts) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


# FlopCounterMode (labkit.transformer.checkpointing.step_flops) counts them as the matmuls they are
@register_flop_formula(torch.ops.labkit.grouped_mm)
def _(x_shape, w_shape, *args, **kwargs) -> int:
    return 2 * x_shape[0] * w_shape[1] * w_shape[2]


@register_flop_formula(torch.ops.labkit.grouped_mm_weight_grad)
def _(grad_y_shape, x_shape, *args, **kwargs) -> int:
    return 2 * x_shape[0] * grad_y_shape[1] * x_shape[1]


def grouped_linear(x, w, counts):
    """``F.linear`` of each group's rows with its own weight: x (N, in), w (G, out, in) -> (N, out).

    Under autocast, bf16 copies of x and w, as autocast makes for ``F.linear``."""
    x, w = autocast_copies(x, w)
    return grouped_mm(x, w, counts)
