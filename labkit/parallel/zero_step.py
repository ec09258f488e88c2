"""The ZeRO mechanism (Rajbhandari et al., 2020), stages 1, 2 and 3, over ``torch.distributed``.

Parameters live in a flat buffer padded to a multiple of N (``zero.shard``); rank r owns the
contiguous slice ``[r * Ψ/N, (r + 1) * Ψ/N)`` of it and keeps AdamW's state (and, under
``bf16-master``, the fp32 master weights) for that slice only. Stages 1 and 2, each step:

    full grads (Ψ,) --reduce-scatter--> my grad shard (Ψ/N,) --AdamW--> my param shard (Ψ/N,)
                                                      --all-gather--> full params (Ψ,)

Stage 1 keeps the full gradients until ``zero_grad`` (only the optimizer state is sharded);
stage 2 frees them as soon as they are reduce-scattered. Both send the paper's 2Ψ: its
all-reduce is a reduce-scatter plus an all-gather, and ZeRO's all-gather is of the updated
parameters instead of the gradients. Stage 3 keeps only the shard between uses: one flat
buffer per unit (each block, and the rest of the model), all-gathered before the unit's forward
and again before its backward, freed after each, its gradients reduce-scattered as soon as its
backward is done: 3Ψ.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch import nn

from .zero import shard

STAGES = (1, 2, 3)
# precision -> parameter dtype; fp64 lets tests compare with one process free of round-off
PRECISIONS = {"fp32": torch.float32, "bf16-master": torch.bfloat16, "fp64": torch.float64}
PAPER_VOLUME = {1: 2, 2: 2, 3: 3}      # the paper's communication per step, in units of Ψ


def paper_bytes(numel: int, stage: int, element_bytes: int) -> int:
    """The paper's communication per step and rank, in bytes: 2Ψ (stages 1, 2) or 3Ψ (stage 3)."""
    return PAPER_VOLUME[stage] * numel * element_bytes


class CommCounter:
    """The collectives ZeRO uses, counting the bytes this rank sends per kind.

    In a ring, a reduce-scatter or all-gather over a buffer of N shards sends N - 1 shards from
    every rank: (N - 1) / N of the buffer, which the paper rounds to the whole buffer (Ψ).
    """

    def __init__(self, group):
        self.group, self.world = group, dist.get_world_size(group=group)
        self.sent = Counter()          # kind -> bytes this rank sent since the last reset

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor):
        """Sum ``full`` (N * k,) over the ranks; this rank keeps its (k,) slice in ``out``."""
        dist.reduce_scatter_single(out, full, group=self.group)
        self.sent["reduce_scatter"] += (self.world - 1) * out.nbytes

    def all_gather(self, full: torch.Tensor, mine: torch.Tensor):
        """Every rank's (k,) ``mine``, in rank order, into ``full`` (N * k,)."""
        dist.all_gather_single(full, mine, group=self.group)
        self.sent["all_gather"] += (self.world - 1) * mine.nbytes

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    def reset(self):
        self.sent.clear()


class FlatShard:
    """Parameters as views into one flat buffer (padded to a multiple of N) and this rank's
    shard of it, the ``master`` AdamW steps (fp32 under bf16-master)."""

    def __init__(self, params, comm: CommCounter, rank: int, master_dtype, in_place: bool):
        self.params, self.comm, self.world = params, comm, comm.world
        self.numel = sum(p.numel() for p in params)                       # Ψ of this unit
        self.shard_numel = shard(self.numel, self.world)                  # its Ψ/N, rounded up
        self.padding = self.shard_numel * self.world - self.numel
        self.flat = torch.zeros(self.numel + self.padding, dtype=params[0].dtype,
                                device=params[0].device)                   # (Ψ + padding,)
        offset = 0
        for p in params:
            self.flat[offset:offset + p.numel()].copy_(p.detach().flatten())
            p.data = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        lo = rank * self.shard_numel
        mine = self.flat[lo:lo + self.shard_numel]                        # (Ψ/N,) my slice
        # in place (stages 1, 2 in the model's dtype): AdamW steps my slice of the flat buffer
        self.master = nn.Parameter(mine if in_place else mine.to(master_dtype, copy=True))
        self.ready = 0                 # stage 3: how many of params have their gradient

    def gather(self):
        """Every rank's shard -> the full flat buffer, which the parameters view."""
        storage = self.flat.untyped_storage()
        if storage.nbytes() == 0:      # freed (stage 3): allocate it again
            storage.resize_(self.flat.nbytes)
        mine = self.master.detach().to(self.flat.dtype, copy=True)       # (Ψ/N,) model dtype
        self.comm.all_gather(self.flat, mine)                             # -> (Ψ + padding,)

    def free(self):
        """Drop the full buffer; the parameters keep their shapes over an empty storage."""
        self.flat.untyped_storage().resize_(0)

    def reduce_grads(self, keep: bool):
        """Sum the full gradients over the ranks into my shard's master gradient, averaged."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        full = torch.cat([g.flatten() for g in grads] + [self.flat.new_zeros(self.padding)])
        if not keep:                   # stages 2, 3: no rank keeps the whole gradient
            for p in self.params:
                p.grad = None
        grad_shard = full.new_empty(self.shard_numel)                      # (Ψ/N,)
        self.comm.reduce_scatter(grad_shard, full)    # (Ψ + padding,) summed -> my (Ψ/N,)
        del full
        # average (PREMUL_SUM does not run on gloo), in the master's dtype (fp32 under bf16)
        grad = grad_shard.to(self.master.dtype).div_(self.world)
        self.master.grad = grad if self.master.grad is None else self.master.grad + grad


class ZeroOptimizer:
    """AdamW over this rank's shards of the model's parameters (ZeRO stage 1, 2 or 3).

    ``model``'s parameters become views into flat buffers; call ``loss.backward()`` on this
    rank's slice of the batch, then ``step()``: gradients are averaged over the group. Stage 3
    shards per block of ``model.blocks`` (the rest of the model is one more unit); every
    parameter must get a gradient in each backward (its unit reduce-scatters when all have).
    ``precision="bf16-master"`` takes a bf16 model and keeps fp32 masters for the shards.
    """

    def __init__(self, model: nn.Module, group, stage: int, precision: str = "fp32",
                 lr: float = 1e-3, weight_decay: float = 0.1, betas=(0.9, 0.999),
                 eps: float = 1e-8):
        if stage not in STAGES:
            raise ValueError(f"stage={stage!r}: ZeRO has stages {STAGES} (1: optimizer state "
                             "sharded, 2: + gradients, 3: + parameters)")
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r}: use one of {sorted(PRECISIONS)}")
        params = [p for p in model.parameters() if p.requires_grad]
        dtype = PRECISIONS[precision]
        wrong = sorted({str(p.dtype) for p in params if p.dtype != dtype})
        if wrong:
            raise ValueError(f"precision={precision!r} needs {dtype} parameters, the model has "
                             f"{wrong}: build it with build_model(cfg, dtype={dtype})")
        if stage == 3 and not hasattr(model, "blocks"):
            raise ValueError("stage 3 gathers one block at a time: the model needs .blocks "
                             "(a labkit Transformer)")
        if stage == 3 and any(getattr(model, "recompute", ())):
            raise ValueError("stage 3 frees each block after its forward, so a recomputed block "
                             "would find no weights: set model.recompute to all False")
        if not isinstance(group, dist.ProcessGroup):
            raise ValueError(f"group={group!r} is not a torch.distributed ProcessGroup: pass the "
                             "group explicitly (ctx.group under labkit.parallel.cluster.run)")
        self.stage, self.precision, self.group, self.params = stage, precision, group, params
        self.comm = CommCounter(group)
        self.world, self.rank = self.comm.world, dist.get_rank(group=group)
        master_dtype = torch.float32 if precision == "bf16-master" else dtype
        if stage < 3:                  # one unit: the whole model, gathered for good
            self.units = [FlatShard(params, self.comm, self.rank, master_dtype,
                                    in_place=master_dtype == dtype)]
        else:                          # a unit per block, and one for the rest (embed, norm, head)
            modules = [model, *model.blocks]
            in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
            groups = [[p for p in params if id(p) not in in_blocks]]
            groups += [[p for p in b.parameters() if p.requires_grad] for b in model.blocks]
            self.units = [FlatShard(ps, self.comm, self.rank, master_dtype, in_place=False)
                          for ps in groups]
            for unit, module in zip(self.units, modules):
                unit.free()
                self._hook(unit, module)
        self.numel = sum(u.numel for u in self.units)                      # Ψ
        self.shard_numel = sum(u.shard_numel for u in self.units)          # this rank's share
        self.inner = torch.optim.AdamW([u.master for u in self.units], lr=lr, betas=betas,
                                       eps=eps, weight_decay=weight_decay, foreach=False)
        self.param_groups = self.inner.param_groups
        self.last_step = {}            # kind -> bytes this rank sent in the last step (fwd + bwd)

    # ---- stage 3: gather before forward and backward, free after, reduce-scatter when done ----
    def _hook(self, unit: FlatShard, module: nn.Module):
        module.register_forward_pre_hook(lambda m, args: unit.gather())
        module.register_forward_hook(lambda m, args, out: self._after_forward(unit, out))
        for p in unit.params:
            p.register_post_accumulate_grad_hook(lambda p: self._grad_ready(unit))

    @staticmethod
    def _after_forward(unit: FlatShard, out):
        unit.free()
        if isinstance(out, torch.Tensor) and out.requires_grad:
            # the gradient of the unit's output arrives just before the unit's own backward
            out.register_hook(lambda grad: unit.gather())

    @staticmethod
    def _grad_ready(unit: FlatShard):
        unit.ready += 1
        if unit.ready == len(unit.params):     # the unit's backward is done
            unit.ready = 0
            unit.reduce_grads(keep=False)
            unit.free()

    # ---- the optimizer ------------------------------------------------------------------
    def state_bytes(self) -> int:
        """AdamW's state on this rank: exp_avg and exp_avg_sq of its shards (fp32: 8 bytes each)."""
        states = [self.inner.state.get(u.master, {}) for u in self.units]
        return sum(s[k].nbytes for s in states for k in ("exp_avg", "exp_avg_sq") if k in s)

    def master_bytes(self) -> int:
        """fp32 master weights on this rank: the shards under bf16-master, none otherwise."""
        return sum(u.master.nbytes for u in self.units) if self.precision == "bf16-master" else 0

    @torch.no_grad()
    def full_parameters(self) -> list:
        """Copies of every parameter, whole, in the model's order (stage 3 gathers each unit
        for it and frees it again; these gathers are not counted)."""
        sent, whole = self.comm.sent.copy(), {}
        for unit in self.units:
            if self.stage == 3:
                unit.gather()
            whole.update({id(p): p.detach().clone() for p in unit.params})
            if self.stage == 3:
                unit.free()
        self.comm.sent = sent
        return [whole[id(p)] for p in self.params]

    @torch.no_grad()
    def step(self):
        if self.stage < 3:             # stage 3 reduce-scattered during the backward pass
            self.units[0].reduce_grads(keep=self.stage == 1)
        self.inner.step()
        for unit in self.units:
            unit.master.grad = None
            if self.stage < 3:         # stage 3 gathers at the next forward
                unit.gather()
        self.last_step = dict(self.comm.sent)
        self.comm.reset()

    def zero_grad(self, set_to_none: bool = True):
        for unit in self.units:
            for p in unit.params:
                p.grad = None
            unit.master.grad = None
