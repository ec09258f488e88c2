"""The ZeRO mechanism (Rajbhandari et al., 2020), stages 1, 2 and 3, over ``torch.distributed``.

Parameters live in a flat buffer padded to a multiple of N (``zero.shard``); rank r owns the
contiguous slice ``[r * Ψ/N, (r + 1) * Ψ/N)`` of it and keeps AdamW's state (and, under
``bf16-master``, the fp32 master weights) for that slice only. Stages 1 and 2, each step:

    full grads (Ψ,) --reduce-scatter--> my grad shard (Ψ/N,) --AdamW--> my param shard (Ψ/N,)
                                                      --all-gather--> full params (Ψ,)

Gradients go into a flat bucket per unit as autograd makes them. Stage 1 has one unit, the
whole model: its full gradients build up over the backward pass and are reduce-scattered at
the step (then dropped, as DeepSpeed does); only the optimizer state is sharded. Stage 2 has a
unit per block (and one for the rest of the model) and reduce-scatters each unit's bucket as
soon as its backward is done, so no rank holds the whole gradient. Both send the paper's 2Ψ:
its all-reduce is a reduce-scatter plus an all-gather, and ZeRO's all-gather is of the updated
parameters instead of the gradients. Stage 3 also keeps only the shard of each unit's
parameters between uses, all-gathered before the unit's forward and again before its
backward, freed after each: 3Ψ. ``offload`` (ZeRO-Offload) keeps the master shards, their
AdamW state and the gradient shards in host memory and steps AdamW there: each step every
gradient shard goes down to the host and every updated shard comes back up.
"""
from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn

from labkit.parallel.comm import CommCounter as ReplicaComm
from labkit.parallel.data.zero import shard
from labkit.parallel.steps import RankStep, measure_rank, rank_tokens
from labkit.training.track import HOST, on_host, tag_live

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
        self.rank = dist.get_rank(group=group)
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


def node_groups(ctx, nodes: int) -> tuple:
    """(this rank's node, its counterparts in the other nodes): process groups for HSDP over
    ``nodes`` nodes of world / nodes consecutive ranks. Every rank makes every group."""
    if nodes < 1 or ctx.world_size % nodes:
        raise ValueError(f"nodes={nodes} must divide the {ctx.world_size} ranks")
    per = ctx.world_size // nodes
    inside = [dist.new_group(list(range(n * per, (n + 1) * per))) for n in range(nodes)]
    across = [dist.new_group(list(range(i, ctx.world_size, per))) for i in range(per)]
    return inside[ctx.rank // per], across[ctx.rank % per]


class OneRank:
    """A group of one rank (an expert shard with no data-parallel copy): nothing is sent."""

    world, rank, total = 1, 0, 0

    def __init__(self):
        self.sent = Counter()

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor):
        out.copy_(full)

    def all_gather(self, full: torch.Tensor, mine: torch.Tensor):
        full.copy_(mine)

    def reset(self):
        pass


class FlatShard:
    """One unit's parameters as views into one flat buffer (padded to a multiple of N), this
    rank's shard of it (``master``, which AdamW steps: fp32 under bf16-master), and the unit's
    gradient bucket while its backward runs. ``divisor``: what the summed gradients are divided
    by (None: the group's ranks; an expert unit's group is only part of the data-parallel world)."""

    def __init__(self, params, comm: CommCounter, rank: int, master_dtype, stage: int,
                 offload: bool = False, divisor: int | None = None, replicas=None):
        self.params, self.comm, self.world = params, comm, comm.world
        self.replicas = replicas       # HSDP: the ranks holding this same shard in other nodes
        self.divisor = divisor or comm.world
        self.numel = sum(p.numel() for p in params)                       # Ψ of this unit
        self.shard_numel = shard(self.numel, self.world)                  # its Ψ/N, rounded up
        self.padding = self.shard_numel * self.world - self.numel
        dtype = params[0].dtype
        self.flat = torch.zeros(self.numel + self.padding, dtype=dtype,
                                device=params[0].device)                   # (Ψ + padding,)
        self.offsets, offset = [], 0
        for p in params:
            self.flat[offset:offset + p.numel()].copy_(p.detach().flatten())
            p.data = self.flat[offset:offset + p.numel()].view_as(p)
            self.offsets.append(offset)
            offset += p.numel()
        lo = rank * self.shard_numel
        mine = self.flat[lo:lo + self.shard_numel]                        # (Ψ/N,) my slice
        # offload: the master (so AdamW's state and the gradient shard too) lives in host memory
        self.offload = offload
        self.home = torch.device("cpu") if offload else mine.device
        # in place (stages 1, 2 in the model's dtype): AdamW steps my slice of the flat buffer
        self.in_place = stage < 3 and master_dtype == dtype and not offload
        self.master = nn.Parameter(mine if self.in_place else
                                   mine.to(self.home, master_dtype, copy=True))
        # stage 3 keeps only a shard of the parameters, in the model's dtype: the master itself,
        # or (bf16-master, as DeepSpeed) a bf16 copy of it; all-gathered before each use
        self.local = None
        if stage == 3 and not offload:
            self.local = self.master.detach() if master_dtype == dtype else mine.clone()
        self.bucket = None             # the unit's full gradients while they are being made
        self.ready = 0                 # how many of params have put their gradient in it
        self.moved = 0                 # bytes copied between host and device (offload)

    def gather(self):
        """Every rank's shard -> the full flat buffer, which the parameters view."""
        storage = self.flat.untyped_storage()
        if storage.nbytes() == 0:      # freed (stage 3): allocate it again
            storage.resize_(self.flat.nbytes)
        if self.local is not None:
            mine = self.local
        else:                          # a copy: my slice of flat is overwritten, or the master
            mine = self.master.detach().to(self.flat.device, self.flat.dtype, copy=True)
            if self.offload:           # host -> device: the updated shard, in the model's dtype
                self.moved += mine.nbytes
        self.comm.all_gather(self.flat, mine)                      # (Ψ/N,) -> (Ψ + padding,)

    def stepped(self, gather: bool):
        """After AdamW: refresh the bf16 shard from its master (stage 3); gather (stages 1, 2)."""
        if self.local is not None and self.local.data_ptr() != self.master.data_ptr():
            self.local.copy_(self.master)
        if gather:
            self.gather()

    def free(self):
        """Drop the full buffer; the parameters keep their shapes over an empty storage."""
        self.flat.untyped_storage().resize_(0)

    def put_grad(self, p: torch.Tensor, i: int) -> bool:
        """Add ``p``'s fresh gradient to the unit's bucket and drop it; True once every one is in."""
        if self.bucket is None:
            self.bucket = self.flat.new_zeros(self.flat.numel())          # (Ψ + padding,)
            tag_live(self.bucket, "grads")
        self.bucket[self.offsets[i]:self.offsets[i] + p.numel()].add_(p.grad.flatten())
        p.grad = None
        self.ready += 1
        return self.ready == len(self.params)

    def reduce_grads(self):
        """Sum the unit's bucket over the ranks into my shard's master gradient, averaged, and
        free the bucket."""
        full, self.bucket, self.ready = self.bucket, None, 0              # (Ψ + padding,)
        grad_shard = full.new_empty(self.shard_numel)                      # (Ψ/N,)
        tag_live(grad_shard, "grads")
        self.comm.reduce_scatter(grad_shard, full)    # (Ψ + padding,) summed -> my (Ψ/N,)
        del full
        if self.replicas is not None:  # HSDP: my shard summed over its copies in other nodes
            self.replicas.all_reduce(grad_shard)
        # average (PREMUL_SUM does not run on gloo), in the master's dtype (fp32 under bf16)
        grad = grad_shard.to(self.home, self.master.dtype).div_(self.divisor)
        if self.offload:               # device -> host: the gradient shard
            self.moved += grad_shard.nbytes
        tag_live(grad, HOST if self.offload else "grads")
        self.master.grad = grad if self.master.grad is None else self.master.grad + grad


class ZeroOptimizer:
    """AdamW over this rank's shards of the model's parameters (ZeRO stage 1, 2 or 3).

    ``model``'s parameters become views into flat buffers; call ``loss.backward()`` on this
    rank's slice of the batch, then ``step()``: gradients are averaged over the group. Stages
    2 and 3 shard per block of ``model.blocks`` (the rest of the model is one more unit), and
    reduce-scatter each unit's gradient bucket as soon as its backward is done; every
    parameter must get a gradient in each backward. ``precision="bf16-master"`` takes a bf16
    model and keeps fp32 masters for the shards. ``offload`` keeps the masters, their AdamW
    state and gradient shards in host memory (ZeRO-Offload): AdamW steps on the host.
    ``experts``: under expert parallelism, this rank's routed experts: units of their own
    (stage 1: one; from stage 2: one per block), sharded over ``expert_group`` (the data-
    parallel copies of its shard; None: no copy), the rest over ``group``, as Megatron's
    distributed optimizer (DeepSeek-V3's ZeRO-1) and FSDP over experts (torchtitan) do.
    ``replica_group``: HSDP - shard over ``group`` (a node), and all-reduce each gradient shard
    over this rank's counterparts in the other nodes after its reduce-scatter.
    """

    def __init__(self, model: nn.Module, group, stage: int, precision: str = "fp32",
                 lr: float = 1e-3, weight_decay: float = 0.1, betas=(0.9, 0.999),
                 eps: float = 1e-8, offload: bool = False, experts=(), expert_group=None,
                 replica_group=None):
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
        if stage >= 2 and not hasattr(model, "blocks"):
            raise ValueError(f"stage {stage} works one block at a time: the model needs .blocks "
                             "(a labkit Transformer)")
        if stage == 3 and any(not p.requires_grad and p.dim() > 1 for p in model.parameters()):
            raise ValueError("stage 3 here shards only what trains: a frozen base (LoRA's) "
                             "would stay whole on every rank; shard it with FSDP2 "
                             "(labkit.parallel.data.fsdp.shard_blocks), or use stage 1 or 2")
        if stage == 3 and any(getattr(model, "recompute", ())):
            raise ValueError("stage 3 frees each block after its forward, so a recomputed block "
                             "would find no weights: set model.recompute to all False")
        if not isinstance(group, dist.ProcessGroup):
            raise ValueError(f"group={group!r} is not a torch.distributed ProcessGroup: pass the "
                             "group explicitly (ctx.group under labkit.parallel.cluster.run)")
        self.stage, self.precision, self.group, self.params = stage, precision, group, params
        if replica_group is not None and experts:
            raise ValueError("replica_group (HSDP) with expert units is not modelled: shard the "
                             "experts over expert_group without replicas, or drop replica_group")
        self.comm = CommCounter(group)
        self.world, self.rank = self.comm.world, dist.get_rank(group=group)
        self.replicas = None if replica_group is None else ReplicaComm(replica_group)
        if self.replicas:              # one tally of what this rank sends
            self.replicas.sent = self.comm.sent
        copies = self.replicas.world if self.replicas else 1
        # the experts' units: over their own copies, averaged over every rank as the rest
        self.expert_comm = OneRank() if expert_group is None else CommCounter(expert_group)
        master_dtype = torch.float32 if precision == "bf16-master" else dtype
        self.units = []
        for ps, expert, module in self._unit_params(model, {id(p) for p in experts}):
            comm = self.expert_comm if expert else self.comm
            self.units.append(FlatShard(ps, comm, comm.rank, master_dtype, stage, offload,
                                        divisor=self.world * copies, replicas=self.replicas))
            self._hook(self.units[-1], module)
        self.numel = sum(u.numel for u in self.units)                      # Ψ
        self.shard_numel = sum(u.shard_numel for u in self.units)          # this rank's share
        self.inner = torch.optim.AdamW([u.master for u in self.units], lr=lr, betas=betas,
                                       eps=eps, weight_decay=weight_decay, foreach=False)
        self.param_groups = self.inner.param_groups
        self.offload = offload
        self.last_step = {}            # kind -> bytes this rank sent in the last step (fwd + bwd)
        self.last_step_by_group = {}   # "world" (the group), "dp" (the experts' group) -> bytes
        self.last_moved = 0            # bytes copied between host and device in the last step

    def _unit_params(self, model: nn.Module, experts: set) -> list[tuple]:
        """(parameters, whether they are experts, the module whose forward uses them) of each
        unit: stage 1 the whole model; from stage 2 the rest (embedding, norm, head), then each
        block. With ``experts`` (ids), their parameters form units of their own in each."""
        def split(ps, module):
            ps = [p for p in ps if p.requires_grad]
            return [(part, expert, module) for expert in (False, True)
                    if (part := [p for p in ps if (id(p) in experts) == expert])]
        if self.stage == 1:                # its gradients kept whole until the step
            return split(model.parameters(), model)
        in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
        out = split([p for p in model.parameters() if id(p) not in in_blocks], model)
        return out + [u for b in model.blocks for u in split(b.parameters(), b)]

    # ---- gradients into buckets, reduce-scattered when done (2, 3); gathered around use (3) ---
    def _hook(self, unit: FlatShard, module: nn.Module):
        """Every gradient goes to its unit's bucket; from stage 2 a full bucket is reduce-
        scattered at once, and at stage 3 the unit is gathered around its forward and backward."""
        for i, p in enumerate(unit.params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_ready(unit, p, i))
        if self.stage == 3:
            unit.free()
            module.register_forward_pre_hook(lambda m, args: unit.gather())
            module.register_forward_hook(lambda m, args, out: self._after_forward(unit, out))

    @staticmethod
    def _after_forward(unit: FlatShard, out):
        unit.free()
        if isinstance(out, torch.Tensor) and out.requires_grad:
            # the gradient of the unit's output arrives just before the unit's own backward
            out.register_hook(lambda grad: unit.gather())

    def _grad_ready(self, unit: FlatShard, p: torch.Tensor, i: int):
        if unit.put_grad(p, i) and self.stage >= 2:        # the unit's backward is done
            unit.reduce_grads()
            if self.stage == 3:
                unit.free()

    # ---- the optimizer ------------------------------------------------------------------
    def state_bytes(self) -> int:
        """AdamW's state on this rank: exp_avg and exp_avg_sq of its shards (fp32: 8 bytes each)."""
        states = [self.inner.state.get(u.master, {}) for u in self.units]
        return sum(s[k].nbytes for s in states for k in ("exp_avg", "exp_avg_sq") if k in s)

    def master_bytes(self) -> int:
        """fp32 master weights on this rank: the shards under bf16-master, none otherwise."""
        return sum(u.master.nbytes for u in self.units) if self.precision == "bf16-master" else 0

    @property
    def state(self) -> dict:
        """AdamW's state per master shard (what a ``MemoryTracker`` reads)."""
        return self.inner.state

    def memory_tags(self) -> list:
        """(tensor, category) for what this rank holds apart from the model, for a tracker: the
        master shards (the parameters themselves at stage 3), their gradients and AdamW state;
        all of it ``"host"`` when offloaded."""
        def where(category):
            return HOST if self.offload else category
        master = "optimizer" if self.precision == "bf16-master" else "params"
        out = []
        for u in self.units:
            if not u.in_place:
                out.append((u.master, where(master)))
            if u.local is not None and u.local.data_ptr() != u.master.data_ptr():
                out.append((u.local, "params"))
            if u.master.grad is not None:
                out.append((u.master.grad, where("grads")))
            out += [(v, where("optimizer")) for v in self.inner.state.get(u.master, {}).values()
                    if isinstance(v, torch.Tensor)]
        return out

    def moved_bytes(self) -> int:
        """Bytes copied between host and device since the last step (offload), both ways."""
        return sum(u.moved for u in self.units)

    @torch.no_grad()
    def full_parameters(self) -> list:
        """Copies of every parameter, whole, in the model's order (stage 3 gathers each unit
        for it and frees it again; these gathers are not counted)."""
        sent, moved, whole = self.comm.sent.copy(), [u.moved for u in self.units], {}
        expert_sent = self.expert_comm.sent.copy()
        for unit in self.units:
            if self.stage == 3:
                unit.gather()
            whole.update({id(p): p.detach().clone() for p in unit.params})
            if self.stage == 3:
                unit.free()
        _restore(self.comm.sent, sent)
        _restore(self.expert_comm.sent, expert_sent)
        for unit, m in zip(self.units, moved):
            unit.moved = m
        return [whole[id(p)] for p in self.params]

    @torch.no_grad()
    def averaged_gradients(self) -> dict:
        """Stage 1, after a backward pass: {id(parameter): its gradient averaged over the ranks,
        whole}, reduced as ``step`` reduces them and gathered back (for checks; the bytes sent
        are not counted, nothing is stepped, the gradients are consumed)."""
        if self.stage != 1:
            raise ValueError("averaged_gradients reads stage 1's buckets: use stage=1")
        out = {}
        for unit in self.units:
            sent = unit.comm.sent.copy()
            unit.reduce_grads()
            full = unit.flat.new_empty(unit.flat.numel())                  # (Ψ + padding,)
            unit.comm.all_gather(full, unit.master.grad.to(full.dtype))
            _restore(unit.comm.sent, sent)
            unit.master.grad = None
            out |= {id(p): full[o:o + p.numel()].view_as(p)
                    for p, o in zip(unit.params, unit.offsets)}
        return out

    @torch.no_grad()
    def step(self):
        pending = [i for i, u in enumerate(self.units) if self.stage >= 2 and u.bucket is not None]
        if pending:
            unit = self.units[pending[0]]
            raise ValueError(f"unit {pending[0]}: {len(unit.params) - unit.ready} of its "
                             f"{len(unit.params)} parameters got no gradient in this backward, so "
                             "its gradients were never reduced: give every trainable parameter a "
                             "gradient, or set requires_grad=False on those that get none")
        if self.stage == 1:            # stages 2, 3 reduce-scattered during the backward pass
            for unit in self.units:    # and, as DeepSpeed's stage 1, drop the full gradients
                unit.reduce_grads()
        with on_host() if self.offload else contextlib.nullcontext():
            self.inner.step()              # offloaded: AdamW runs on the host
        for unit in self.units:
            unit.master.grad = None
            unit.stepped(gather=self.stage < 3)    # stage 3 gathers at the next forward
        self.last_step = dict(self.comm.sent) | {f"{kind} (experts, dp group)": n
                                                 for kind, n in self.expert_comm.sent.items()}
        self.last_step_by_group = {"world": self.comm.total, "dp": self.expert_comm.total}
        self.last_moved = self.moved_bytes()
        self.comm.reset()
        self.expert_comm.reset()
        for unit in self.units:
            unit.moved = 0

    def zero_grad(self, set_to_none: bool = True):
        for unit in self.units:
            unit.bucket, unit.ready, unit.master.grad = None, 0, None


def _restore(counter: Counter, saved: Counter):
    """Put back a tally in place (the replicas' counter shares it)."""
    counter.clear()
    counter.update(saved)


def zero_step(ctx, stage: int, model_name: str = "tiny", batch: int = 1, seq: int = 32,
              steps: int = 3, precision: str = "fp32", offload: bool = False,
              lr: float = 1e-2, lora_rank: int = 0, nodes: int = 1) -> RankStep:
    """Train ``steps`` steps of the course model under ZeRO ``stage`` on this rank's rows
    (``batch`` x ``seq`` per rank); the tracker's figures for the last step, and the bytes sent
    (and, offloaded, copied between host and device) in it. ``lora_rank`` > 0: rank-r LoRA
    adapters on the frozen model, the only parameters ZeRO shards (the base stays whole).
    ``nodes`` > 1: HSDP, sharded inside each node of consecutive ranks, replicated across."""
    return train_zero(ctx, stage, model_name, batch, seq, steps, precision, offload, lr,
                      lora_rank, nodes)[0]


def train_zero(ctx, stage: int, model_name: str = "tiny", batch: int = 1, seq: int = 32,
               steps: int = 3, precision: str = "fp32", offload: bool = False,
               lr: float = 1e-2, lora_rank: int = 0, nodes: int = 1) -> tuple:
    """``zero_step``'s run, with the model and the ``ZeroOptimizer`` it trained: (step, model,
    optimizer), for callers that read what the rank holds afterwards."""
    from labkit.core.config import preset
    from labkit.quantisation.lora import apply_lora
    from labkit.transformer.model import build_model

    torch.manual_seed(0)                                 # every rank starts from one model
    model = build_model(preset(model_name), dtype=PRECISIONS[precision]).to(ctx.device)
    if lora_rank:
        apply_lora(model, lora_rank)
    group, replicas = node_groups(ctx, nodes) if nodes > 1 else (ctx.group, None)
    opt = ZeroOptimizer(model, group, stage, precision, lr=lr, offload=offload,
                        replica_group=replicas)
    batches = rank_tokens(ctx, model.cfg.vocab_size, batch, seq, steps)

    def sent():
        return {**opt.last_step, **({"host <-> device": opt.last_moved} if offload else {})}
    step = measure_rank(ctx, model, model, opt, batches,
                        "fp32" if precision == "fp64" else precision, sent=sent)
    return step, model, opt


def zero_steps(ctx, cases) -> list:
    """``zero_step`` for each case ``(stage, model, batch, seq[, precision[, offload[,
    lora_rank[, nodes]]]])`` on this rank, in one process group (one start-up for all); stage 0
    is DDP (``ddp.ddp_step``)."""
    from labkit.parallel.data.ddp import ddp_step

    out = []
    for stage, model, batch, seq, *more in cases:
        precision, offload, lora_rank, nodes = more + ["fp32", False, 0, 1][len(more):]
        out.append(ddp_step(ctx, model, batch, seq, precision=precision,
                            trainable="lora" if lora_rank else "all", lora_rank=lora_rank or 16)
                   if stage == 0 else
                   zero_step(ctx, stage, model, batch, seq, 3, precision, offload,
                             lora_rank=lora_rank, nodes=nodes))
    return out
