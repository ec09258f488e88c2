"""The messages of tensor and sequence parallelism, as autograd Functions (Megatron-LM).

Tensor parallelism (Shoeybi et al., 2019, figure 3) brackets each parallel sub-layer with two
conjugate operators; sequence parallelism (Korthikanti et al., 2022, figure 5) splits the
tokens between the sub-layers and trades f and g for an all-gather and a reduce-scatter:

    operator                        forward                  backward
    f  copy_to_parallel             identity                 all-reduce
    g  reduce_from_parallel         all-reduce               identity
    g  gather_from_sequence         all-gather along T       reduce-scatter along T
    ḡ  reduce_scatter_to_sequence   reduce-scatter along T   all-gather along T

Every operator takes a ``CommCounter``: the group to talk over, passed explicitly, and the bytes
this rank has sent on it, per collective. Activations are (B, T, hidden): the sequence is dim 1,
and the collectives split and join dim 0, so T is moved to the front for the message (a copy
only when B > 1; Megatron keeps (T, B, hidden) throughout instead).
"""
from __future__ import annotations

import torch

from labkit.parallel.comm import CommCounter

# ---- the sequence dimension ----------------------------------------------------------------
def check_tokens(T: int, comm: CommCounter):
    """Sequence parallelism gives each rank T / N tokens: N must divide T."""
    if T % comm.world:
        raise ValueError(f"sequence parallelism splits the {T} tokens of a row over {comm.world} "
                         f"ranks: use a sequence length divisible by {comm.world}, or sp=False")


def all_gather_tokens(x: torch.Tensor, comm: CommCounter) -> torch.Tensor:
    """(B, T/N, ...) on each rank -> (B, T, ...): the ranks' tokens in rank order."""
    mine = x.transpose(0, 1).contiguous()                                 # (T/N, B, ...)
    full = mine.new_empty((comm.world * mine.shape[0], *mine.shape[1:]))  # (T, B, ...)
    comm.all_gather(full, mine)
    return full.transpose(0, 1).contiguous()                              # (B, T, ...)


def reduce_scatter_tokens(x: torch.Tensor, comm: CommCounter) -> torch.Tensor:
    """(B, T, ...) partial sums on each rank -> (B, T/N, ...): this rank's tokens, summed."""
    check_tokens(x.shape[1], comm)
    full = x.transpose(0, 1).contiguous()                                 # (T, B, ...)
    mine = full.new_empty((full.shape[0] // comm.world, *full.shape[1:]))  # (T/N, B, ...)
    comm.reduce_scatter(mine, full)
    return mine.transpose(0, 1).contiguous()                              # (B, T/N, ...)


def my_tokens(x: torch.Tensor, comm: CommCounter) -> torch.Tensor:
    """(B, T, ...) -> this rank's (B, T/N, ...), a copy: a view would keep all T tokens alive."""
    check_tokens(x.shape[1], comm)
    n = x.shape[1] // comm.world
    return x[:, comm.rank * n:(comm.rank + 1) * n].clone(memory_format=torch.contiguous_format)


# ---- the operators ----------------------------------------------------------------------------
class CopyToParallel(torch.autograd.Function):
    """f: the input every rank holds goes into a parallel region as it is; the gradients that
    come back are partial sums (each rank's share of the outputs), added up by an all-reduce."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)            # no copy: the same bytes, a new autograd node

    @staticmethod
    def backward(ctx, grad):           # a copy: autograd may hand the same gradient elsewhere
        return ctx.comm.all_reduce(grad.clone(memory_format=torch.contiguous_format)), None


class ReduceFromParallel(torch.autograd.Function):
    """g: the partial sums of a row-parallel matmul, added up by an all-reduce (in place); the
    gradient of the sum is the same on every rank, passed back as it is."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.mark_dirty(x)              # the all-reduce overwrites the partial sums
        return comm.all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromSequence(torch.autograd.Function):
    """g (sequence parallel): all-gather the tokens. Backward: reduce-scatter, since the consumer
    is tensor-parallel (its input gradients are partial sums over the ranks)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return all_gather_tokens(x, comm)                                 # (B, T, h)

    @staticmethod
    def backward(ctx, grad):                                              # (B, T, h)
        return reduce_scatter_tokens(grad, ctx.comm), None                # (B, T/N, h)


class ReduceScatterToSequence(torch.autograd.Function):
    """ḡ: partial sums over all T tokens -> this rank's T/N tokens, summed; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return reduce_scatter_tokens(x, comm)                             # (B, T/N, h)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_tokens(grad, ctx.comm), None                    # (B, T, h)


def copy_to_parallel(x, comm: CommCounter):
    return CopyToParallel.apply(x, comm)


def reduce_from_parallel(x, comm: CommCounter):
    return ReduceFromParallel.apply(x, comm)


def gather_from_sequence(x, comm: CommCounter):
    return GatherFromSequence.apply(x, comm)


def reduce_scatter_to_sequence(x, comm: CommCounter):
    return ReduceScatterToSequence.apply(x, comm)


def sum_grad_over_ranks(param: torch.nn.Parameter, comm: CommCounter):
    """A replicated weight that each rank applies to its own tokens (a norm under sequence
    parallelism) gets a partial gradient: all-reduce each fresh one before it is accumulated.
    A frozen weight (LoRA's norms) gets none: nothing to do."""
    if not param.requires_grad:
        return None
    return param.register_hook(lambda grad: comm.all_reduce(grad.clone()))
