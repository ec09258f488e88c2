"""Expert tensor parallelism (EP x ETP): each routed expert's SwiGLU split over ``etp`` ranks, as
Megatron-LM's ``--expert-tensor-parallel-size`` does, inside ``ep``-way expert parallelism.

``world = ep x etp`` ranks, each training on its own rows; attention, the router and the shared
experts are replicated (data parallel; Megatron's "MoE parallel folding" with tensor parallel
size 1 for them). Rank r holds expert shard s = r // etp (experts [s E/ep, (s + 1) E/ep)) and,
of each of those experts, slice t = r % etp of its ffn width: rows [t f/etp, (t + 1) f/etp) of
w_gate and w_up (column parallel), the same columns of w_down (row parallel). Its groups:

    etp group s   ranks [s etp, (s + 1) etp)   the same experts, split: gather and reduce-scatter
    ep group t    ranks {t, t + etp, ...}      one slice t of every expert: the all_to_alls

    ep 2 x etp 2:  etp groups {0, 1} {2, 3};  ep groups {0, 2} {1, 3}

A MoE layer on rank (s, t), its rows sorted by expert:

    x_sorted (N k, h)  --all_to_all in ep group t-->  (M, h): the rows for shard s's experts
      --all-gather in etp group s-->   (M_0 + ... + M_etp-1, h): every slice needs every row
      --grouped SwiGLUs on slice t-->  (sum M, h): partial sums (w_down is row parallel)
      --reduce-scatter in etp group s--> (M, h): my rows, summed over the slices
      --all_to_all back-->             (N k, h)

Rows reach shard s's experts from every rank (through their ep groups, then the gather), so an
expert slice's gradient already sums every rank's rows: no expert all-reduce (Megatron's expert
data-parallel size is world / (ep x etp) = 1 here); the replicated weights are all-reduced over
the world, and every gradient divided by it (``expert_parallel.average_gradients``).

Memory on a rank, against ep x etp ranks of plain expert parallelism (the same expert weights
per rank), under balanced routing: each expert input is gathered, so the rank keeps etp x M rows
of h where plain EP keeps M, while the SwiGLU's four (rows, f) tensors stay M f (etp x M rows of
f / etp). Under skew a rank's f-wide tensors follow the mean of its etp group's plain-EP loads,
its gathered rows their sum: it keeps less when the hot experts are one plain-EP rank's, as much
or more when they fill its whole shard (lab 05 measures both).
Megatron-LM gathers uneven rows with ``gather_from_sequence_parallel_region(...,
output_split_sizes=...)`` and ``reduce_scatter_to_sequence_parallel_region``; the row-by-row
broadcasts and reduces here teach the same exchange on gloo.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.parallel.cluster import RankContext
from labkit.parallel.comm import AllToAll, CommCounter
from labkit.parallel.expert.expert_parallel import (EPGroups, ExpertComm, ExpertShard,
                                                    ep_dp_step, forward_backward, seeded_model)
from labkit.parallel.expert.compose import experts_per_rank
from labkit.transformer.model import MoE


def check_etp(cfg, world: int, ep: int, etp: int) -> None:
    """ValueError naming the fix unless ``world = ep x etp`` and etp divides the experts' ffn."""
    for name, n in (("ep", ep), ("etp", etp)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{name}={n!r} must be a whole number >= 1")
    if ep * etp != world:
        raise ValueError(f"ep x etp = {ep} x {etp} must be the {world} ranks: every rank holds "
                         f"one slice of one expert shard (choose ep = {world} // etp)")
    experts_per_rank(cfg, ep)
    if cfg.moe_ffn % etp:
        raise ValueError(f"etp={etp} must divide the experts' ffn width {cfg.moe_ffn}")


# ---- the gather and the reduce-scatter over uneven rows ----------------------------------------
def _gather_rows(x, sizes: list[int], comm: CommCounter, name: str):
    """(sum(sizes), h): every rank's x (sizes[j] rows on rank j), in rank order. Each rank
    broadcasts its rows into its slice of one output, so no input is copied etp times."""
    out = x.new_empty(sum(sizes), *x.shape[1:])
    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    out[starts[comm.rank]:starts[comm.rank] + sizes[comm.rank]] = x
    for j, (start, n) in enumerate(zip(starts, sizes)):
        if n:
            comm._run(lambda rows: dist.broadcast(rows, group=comm.group, group_src=j),
                      out[start:start + n])
    comm.sent[name] += (comm.world - 1) * x.nbytes       # my rows, once to each other rank
    return out


def _reduce_scatter_rows(y, sizes: list[int], comm: CommCounter, name: str):
    """(sizes[me], h): my rows of ``y`` (sum(sizes), h) summed over the group's ranks. Works in
    place on y (not kept for the backward pass)."""
    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    for j, (start, n) in enumerate(zip(starts, sizes)):
        if n:
            comm._run(lambda rows: dist.reduce(rows, group=comm.group, group_dst=j),
                      y[start:start + n])
    me = comm.rank
    comm.sent[name] += (y.shape[0] - sizes[me]) * y[:1].nbytes   # every other rank's rows, once
    return y[starts[me]:starts[me] + sizes[me]].clone()


class GatherRows(torch.autograd.Function):
    """All-gather of uneven rows forward, reduce-scatter of their gradients backward."""

    @staticmethod
    def forward(ctx, x, sizes, comm):
        ctx.route = (sizes, comm)
        return _gather_rows(x, sizes, comm, "gather (etp)")

    @staticmethod
    def backward(ctx, grad):
        sizes, comm = ctx.route
        return _reduce_scatter_rows(grad.clone(), sizes, comm, "gather (etp, backward)"), None, None


class ReduceScatterRows(torch.autograd.Function):
    """Reduce-scatter of uneven rows forward, all-gather of their gradients backward."""

    @staticmethod
    def forward(ctx, y, sizes, comm):
        ctx.route = (sizes, comm)
        return _reduce_scatter_rows(y.clone(), sizes, comm, "reduce-scatter (etp)")

    @staticmethod
    def backward(ctx, grad):
        sizes, comm = ctx.route
        return _gather_rows(grad, sizes, comm, "reduce-scatter (etp, backward)"), None, None


# ---- the layer ---------------------------------------------------------------------------------
class ExpertTensorShard(ExpertShard):
    """``ExpertShard`` whose experts hold slice ``tensor.rank`` of their ffn width: the rows it
    receives are gathered over its etp group and its partial outputs reduce-scattered back."""

    def __init__(self, experts, comm: ExpertComm, tensor: CommCounter):
        super().__init__(experts, comm)
        f = experts.w_gate.shape[1] // tensor.world
        cut = slice(tensor.rank * f, (tensor.rank + 1) * f)
        with torch.no_grad():
            for name in ("w_gate", "w_up"):                # (E/ep, f/etp, h): column parallel
                setattr(self.local, name, nn.Parameter(getattr(self.local, name)[:, cut].clone()))
            self.local.w_down = nn.Parameter(self.local.w_down[:, :, cut].clone())  # row parallel
        self.tensor = tensor

    def forward(self, x_sorted, counts: list[int]):
        """x_sorted (N*k, h): rows sorted by expert, counts[e] of them for expert e (all E)."""
        L, comm, tensor = self.per_rank, self.comm, self.tensor
        incoming = self.incoming(counts, x_sorted)                            # (ep, L) ints
        send = [sum(counts[r * L:(r + 1) * L]) for r in range(self.ep)]       # rows to rank r
        recv = [sum(row) for row in incoming]                                 # rows from rank r
        comm.received.append(sum(recv))
        x = AllToAll.apply(x_sorted, send, recv, comm, "dispatch")               # (M, h)
        # every slice of my experts needs every row sent to them: gather over the etp group
        mine = torch.tensor(incoming, device=x.device).flatten()              # (ep * L,)
        peers = torch.empty(tensor.world * mine.numel(), dtype=mine.dtype, device=x.device)
        tensor._run(lambda peers, mine: dist.all_gather_single(peers, mine, group=tensor.group),
                    peers, mine)
        tensor.sent["counts (etp)"] += (tensor.world - 1) * mine.nbytes
        flat = peers.tolist()                                                 # (etp * ep * L,)
        sizes = [sum(flat[j * len(mine):(j + 1) * len(mine)]) for j in range(tensor.world)]
        gathered = GatherRows.apply(x, sizes, tensor)                         # (sum M, h)
        expert_of_row = torch.arange(L, device=x.device).repeat(tensor.world * self.ep) \
            .repeat_interleave(torch.tensor(flat, device=x.device), output_size=sum(sizes))
        by_expert = expert_of_row.argsort(stable=True)                        # (sum M,)
        per_expert = [sum(flat[j::L]) for j in range(L)]                      # (L,) ints
        comm.expert_rows.append(per_expert)
        y = self.local(gathered[by_expert], per_expert)                       # (sum M, h) partial
        y = ReduceScatterRows.apply(y[by_expert.argsort()], sizes, tensor)    # (M, h) summed
        return AllToAll.apply(y, recv, send, comm, "combine")                    # (N*k, h)


@dataclass
class ETPGroups(EPGroups):
    """``EPGroups`` with this rank's etp group (``tensor``): the gathers and reduce-scatters."""

    tensor: CommCounter | None = None

    def reset(self):
        super().reset()
        self.tensor.reset()

    def sent(self) -> dict[str, int]:
        return super().sent() | dict(self.tensor.sent)

    def sent_by_group(self) -> dict[str, int]:
        return super().sent_by_group() | {"etp": self.tensor.total}


def expert_tensor_parallel(model: nn.Module, ctx: RankContext, ep: int, etp: int) -> ETPGroups:
    """Turn this rank's copy of a labkit MoE model into its (shard r // etp, slice r % etp) part,
    in place, and make the groups (every rank must call it, in the same order)."""
    check_etp(model.cfg, ctx.world_size, ep, etp)
    etp_groups = [dist.new_group(list(range(s * etp, (s + 1) * etp))) for s in range(ep)]
    ep_groups = [dist.new_group(list(range(t, ctx.world_size, etp))) for t in range(etp)]
    s, t = divmod(ctx.rank, etp)
    groups = ETPGroups(ExpertComm(ep_groups[t], ep, s), None,
                       CommCounter(ctx.group, ctx.world_size, ctx.rank),
                       CommCounter(etp_groups[s], etp, t))
    for module in model.modules():
        if isinstance(module, MoE):
            module.experts = ExpertTensorShard(module.experts, groups.experts, groups.tensor)
    return groups


def build(ctx: RankContext, model_name: str = "tiny-moe", hot: float | None = None,
          seed: int = 0, dtype: torch.dtype = torch.float32, ep: int | None = None,
          etp: int = 2, hot_ep: int | None = None):
    """This rank's part of ``seeded_model`` under ep x etp (ep None: world / etp), its groups.
    ``hot`` biases the first E / hot_ep experts; None: E / (ep x etp), those one rank of
    ep x etp-way expert parallelism holds (the two layouts then meet the same router)."""
    ep = ctx.world_size // etp if ep is None else ep
    model = seeded_model(model_name, hot_ep or ep * etp, hot, seed, dtype, ctx.device)
    return model, expert_tensor_parallel(model, ctx, ep, etp)


def etp_step(ctx, etp: int = 2, hot_ep: int | None = None, **settings):
    """``expert_parallel.ep_dp_step`` under ep = world / etp x etp: a rank's measured step (its
    ``dp``: 1, the copies of each expert slice). ``hot_ep``: as ``build``'s."""
    if settings.get("zero_stage") or settings.get("lora_rank"):
        raise ValueError("expert tensor parallelism here trains with plain AdamW: use "
                         "zero_stage=0 and lora_rank=0")
    step = ep_dp_step(ctx, ctx.world_size // etp, **settings,
                      builder=partial(build, etp=etp, hot_ep=hot_ep))
    return replace(step, dp=1)


def etp_forward_backward(ctx, etp: int = 2, **settings) -> dict:
    """``expert_parallel.forward_backward`` under ep = world / etp x etp."""
    return forward_backward(ctx, ep=ctx.world_size // etp, builder=partial(build, etp=etp),
                            **settings)
