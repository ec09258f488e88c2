"""What the FullyShardedDataParallel tests run on each rank (spawn imports them by name): the
DataParallel tests' small models, trained under labkit's FSDP or torch's FSDP2."""
from __future__ import annotations

import contextlib

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
import weakref

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from data_parallel_targets import MODELS, loss_of, make_optimizer, rows
from labkit.parallel.data import fsdp, fully_sharded
from labkit.parallel.data.fully_sharded import FullyShardedDataParallel


@dataclass
class Sharded:
    """A run's losses (this rank's), its whole weights at the end by name, what each rank kept
    (parameter elements, its .grad shapes after the last backward) and the weights autograd
    kept as notes in the last forward."""

    losses: list
    final: dict
    kept_numel: int
    grad_shapes: dict
    notes: int = 0
    whole_after_forward: int = 0      # whole weights gathered in the forward still alive after it
    sent: dict | None = None          # labkit's: bytes sent in the last step, by collective


def train(ctx, model_name="mlp", wrapper="labkit", optimizer="adamw", steps=3, units=(nn.Linear,),
          compute_dtype=None, replicate_biases=False, dtype=torch.float64, accumulate=1,
          fail_once=False, no_sync=False, hsdp=False) -> Sharded:
    """``steps`` steps of ``model_name`` on this rank's rows under ``wrapper`` ("labkit":
    FullyShardedDataParallel; "torch": FSDP2, ``fully_shard`` on each of ``units``, then the
    root); ``accumulate`` micro-batches per step, all but the last without reducing gradients
    if ``no_sync``; ``fail_once``: a forward on rows of the wrong width raises (and is caught)
    before the second step. ``hsdp`` (4 ranks as 2 x 2): shard over ranks {0, 1} and {2, 3},
    replicate over {0, 2} and {1, 3}."""
    torch.manual_seed(0)
    net = MODELS[model_name]().to(dtype)
    group, replicas = ctx.group, None
    if hsdp:               # every rank makes every group, in the same order
        shards = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        copies = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        group, replicas = shards[ctx.rank // 2], copies[ctx.rank % 2]
    if wrapper == "labkit":
        replicate = (lambda name, p: name.endswith("bias")) if replicate_biases else None
        model = FullyShardedDataParallel(net, group, units=units, replicate=replicate,
                                         compute_dtype=compute_dtype, replica_group=replicas)
    else:
        mesh = (DeviceMesh.from_group([replicas, group], "cpu", mesh=torch.arange(4).view(2, 2),
                                      mesh_dim_names=("replicate", "shard")) if hsdp
                else DeviceMesh.from_group(ctx.group, "cpu"))
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=dtype)
        for module in net.modules():
            if module is not net and isinstance(module, units):
                fully_shard(module, mesh=mesh, mp_policy=policy)
        model = fully_shard(net, mesh=mesh, mp_policy=policy)
    opt = make_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad])
    losses, notes, alive = [], 0, 0
    for step in range(steps):
        if fail_once and step == 1:
            with contextlib.suppress(RuntimeError):
                model(torch.zeros(2, 3, dtype=dtype))          # 3 features, not 8: raises
        if wrapper == "labkit":
            model.sent.clear()
        for micro in range(accumulate):
            inputs, targets = rows(model_name, step * accumulate + micro, ctx.rank, dtype)
            hold = no_sync and micro < accumulate - 1
            if wrapper == "torch":
                model.set_requires_gradient_sync(not hold)
            with _watch_gathers() as gathered:
                loss = loss_of(model_name, model, inputs, targets, step, ctx.rank) / accumulate
            if wrapper == "labkit":
                notes, alive = model.notes, sum(ref() is not None for ref in gathered)
            with model.no_sync() if hold and wrapper == "labkit" else contextlib.nullcontext():
                loss.float().backward()
        grad_shapes = {n: tuple(p.grad.shape) for n, p in model.named_parameters()
                       if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if wrapper == "labkit":
        final = model.full_state_dict()
        final = {n: final[n] for n, _ in net.named_parameters()}
        kept = sum(p.numel() for p in model.parameters())
    else:
        final = {n: p.full_tensor().detach().clone() for n, p in net.named_parameters()}
        kept = sum(p.to_local().numel() for p in net.parameters())
    sent = dict(model.sent) if wrapper == "labkit" else None
    return Sharded(losses, final, kept, grad_shapes, notes, alive, sent)


@contextlib.contextmanager
def _watch_gathers():
    """Weak references to every whole weight labkit's FSDP gathers inside the block."""
    refs, gather = [], fully_sharded._Sharded.gather

    def watched(self, dtype=None):
        weight = gather(self, dtype)
        refs.append(weakref.ref(weight))
        return weight
    fully_sharded._Sharded.gather = watched
    try:
        yield refs
    finally:
        fully_sharded._Sharded.gather = gather


def train_all(ctx, settings: list[dict]) -> list[Sharded]:
    """``train(ctx, **s)`` for each of ``settings`` in one process group (one start-up)."""
    return [train(ctx, **s) for s in settings]


def blocks_side_by_side(ctx, model_name: str, seq: int) -> tuple:
    """labkit's transformer with a unit per block: (FSDP2's ShardStep, labkit FSDP's)."""
    return fsdp.fsdp2_step(ctx, model_name, 1, seq), fsdp.labkit_fsdp_step(ctx, model_name, 1, seq)
