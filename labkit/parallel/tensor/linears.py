"""The linear layers tensor parallelism splits (``tensor_parallel`` builds the model from them):
column-parallel (outputs split, no message) and row-parallel (inputs split, the partial sums
added by an all-reduce, or a reduce-scatter under sequence parallelism), and LoRA adapters over
each, split as Megatron's and PEFT's parallel LoRA split them.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from labkit.parallel.comm import CommCounter
from labkit.parallel.tensor.comm import (reduce_from_parallel, reduce_scatter_to_sequence,
                                         sum_grad_over_ranks)
from labkit.quantisation.quant import LoRALinear

__all__ = ["ColumnParallelLinear", "ColumnParallelLoRA", "RowParallelLinear", "RowParallelLoRA",
           "rank_slice", "split_column", "split_row"]


def rank_slice(weight: nn.Parameter, dim: int, rank: int, world: int) -> nn.Parameter:
    """This rank's 1/N slice of a one-process weight along ``dim``, a copy of its own; frozen
    if the weight is (LoRA's base)."""
    mine = weight.detach().chunk(world, dim=dim)[rank].clone()
    return nn.Parameter(mine, requires_grad=weight.requires_grad)


# ---- the two linear layers --------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split along its columns (outputs), A = [A_1, ..., A_N]: rank i holds
    A_i (in -> out/N) and b_i, and computes its out/N outputs Y_i = X A_i + b_i; no message.

    X must be the same on every rank: the sub-layer enters the parallel region once
    (``column_parallel``) for all the projections that read X (q, k, v; gate, up), so that X
    is sent and saved once (Megatron fuses those weights into one matrix instead).
    """

    def __init__(self, linear: nn.Linear, rank: int, world: int):
        super().__init__()
        self.weight = rank_slice(linear.weight, 0, rank, world)                    # (out/N, in)
        self.bias = None if linear.bias is None else rank_slice(linear.bias, 0, rank, world)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)                            # (..., out/N)


class RowParallelLinear(nn.Module):
    """Y = X A with A split along its rows (inputs), A = [A_1; ...; A_N], and X split along its
    columns as a column-parallel layer leaves it, X = [X_1, ..., X_N]: rank i computes the
    partial sum X_i A_i over all outputs, and g adds the N of them (all-reduce) - or, under
    sequence parallelism, ḡ adds them and leaves each rank its T/N tokens (reduce-scatter).
    """

    def __init__(self, linear: nn.Linear, comm: CommCounter, sp: bool = False):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("a row-parallel projection adds its bias once, after the sum: "
                             "labkit's wo and w_down have none; build the linear with bias=False")
        self.weight = rank_slice(linear.weight, 1, comm.rank, comm.world)          # (out, in/N)
        self.comm, self.sp = comm, sp

    def forward(self, x):                                                     # (B, T, in/N)
        partial = F.linear(x, self.weight)                                    # (B, T, out)
        if self.sp:
            return reduce_scatter_to_sequence(partial, self.comm)             # (B, T/N, out)
        return reduce_from_parallel(partial, self.comm)                       # (B, T, out)


# ---- LoRA's adapters on the split linears ---------------------------------------------------
class _SplitLoRA(LoRALinear):
    """An adapter over a split linear: ``lora``'s rank, alpha, scaling and dropout; the
    subclass splits its base, A and B. Under sp (``column_parallel``) a column target's A reads
    the all-gathered tokens, keeping only this rank's, and a row target's sum is
    reduce-scattered."""

    def __init__(self, lora: LoRALinear):
        nn.Module.__init__(self)
        if lora.dropout.p:
            raise ValueError("LoRA dropout would draw another mask on each rank of a split "
                             "adapter; use dropout=0 with tp")
        if not isinstance(lora.base, nn.Linear):
            raise ValueError("an NF4 (QLoRA) base cannot be split after quantisation: quantise "
                             "each rank's slice instead; here use weight_format=None with tp")
        self.r, self.alpha, self.scaling, self.dropout = (lora.r, lora.alpha, lora.scaling,
                                                          lora.dropout)

    def merge(self):
        raise ValueError("merge() folds B A into a whole weight: merge the LoRALinear before "
                         "parallelize, or gather this rank's slices first")


class ColumnParallelLoRA(_SplitLoRA):
    """A column-parallel target and its adapter, split as Megatron's and PEFT's parallel LoRA
    split them: B (out/N x r) like the weight's outputs, A (r x in) whole on every rank. A's
    gradient on a rank is a partial sum over its outputs, all-reduced (Megatron all-reduces the
    gradient of x A^T instead: the same sum)."""

    def __init__(self, lora: LoRALinear, comm: CommCounter):
        super().__init__(lora)
        self.base = ColumnParallelLinear(lora.base, comm.rank, comm.world)
        self.A = nn.Parameter(lora.A.detach().clone())                        # (r, in)
        self.B = rank_slice(lora.B, 0, comm.rank, comm.world)                      # (out/N, r)
        sum_grad_over_ranks(self.A, comm)


class RowParallelLoRA(_SplitLoRA):
    """A row-parallel target and its adapter: A (r x in/N) split like the weight's inputs, B
    (out x r) whole. x_i A_i^T B^T is a partial sum over the ranks as x_i W_i^T is: both go into
    one all-reduce. B's gradient, from the partial x_i A_i^T, is all-reduced (Megatron
    all-reduces x A^T in the forward pass instead)."""

    def __init__(self, lora: LoRALinear, comm: CommCounter, sp: bool = False):
        super().__init__(lora)
        self.base = RowParallelLinear(lora.base, comm, sp)
        self.A = rank_slice(lora.A, 1, comm.rank, comm.world)                      # (r, in/N)
        self.B = nn.Parameter(lora.B.detach().clone())                        # (out, r)
        self.comm = comm
        sum_grad_over_ranks(self.B, comm)

    def forward(self, x):                                                     # (B, T, in/N)
        partial = self.added(F.linear(x, self.base.weight), self.update(x))   # (B, T, out)
        if self.base.sp:
            return reduce_scatter_to_sequence(partial, self.comm)             # (B, T/N, out)
        return reduce_from_parallel(partial, self.comm)                       # (B, T, out)


def split_column(linear, comm: CommCounter):
    if isinstance(linear, LoRALinear):
        return ColumnParallelLoRA(linear, comm)
    return ColumnParallelLinear(linear, comm.rank, comm.world)


def split_row(linear, comm: CommCounter, sp: bool):
    return RowParallelLoRA(linear, comm, sp) if isinstance(linear, LoRALinear) else (
        RowParallelLinear(linear, comm, sp))
