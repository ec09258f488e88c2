"""What the ShardedOptimizer tests run on each rank (spawn imports them by name, so they live here):
small models that are not labkit's, trained under labkit's ShardedOptimizer, under torch's
ZeroRedundancyOptimizer (behind torch's DDP, which averages the gradients for it), or in one
process on every rank's rows."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import StepLR

from data_parallel_targets import MLP, FrozenBackbone, rows
from labkit.parallel.data.sharded_optimizer import ShardedOptimizer
from labkit.training.track import MemoryTracker

HIDDEN = 7                 # odd widths: the flat buffers need padding at N = 2 and N = 4
STEPS = 3
OPTIMIZERS = {"adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
              "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
              "adam": (torch.optim.Adam, dict(lr=1e-2)),
              "adagrad": (torch.optim.Adagrad, dict(lr=0.1))}
# the "groups" model: (weights' options, biases' options) per optimizer
GROUP_OPTIONS = {"adamw": (dict(lr=1e-2, weight_decay=0.1), dict(lr=3e-2, weight_decay=0.0)),
                 "sgd": (dict(lr=0.1, weight_decay=1e-2), dict(lr=0.05, momentum=0.5))}


class MixedDtypes(nn.Module):
    """An fp64 body under an fp32 head: one parameter group, two flat buffers (one per dtype)."""

    def __init__(self):
        super().__init__()
        self.body = MLP(8, HIDDEN, HIDDEN).double()
        self.head = nn.Linear(HIDDEN, 4)

    def forward(self, x):               # (rows, 8) fp64 -> (rows, 4) fp32
        return self.head(torch.tanh(self.body(x)).float())


def make_model(model_name: str) -> nn.Module:
    """The same weights in every process: "mlp" and "groups" (one MLP, split into two parameter
    groups), "frozen" (a frozen backbone under an MLP), "mixed" (MixedDtypes)."""
    torch.manual_seed(0)
    if model_name == "frozen":
        return FrozenBackbone(8, HIDDEN, 4).double()
    if model_name == "mixed":
        return MixedDtypes()
    return MLP(8, HIDDEN, 4).double()


def params_of(model: nn.Module, model_name: str, optimizer: str):
    """What the optimizer is given: every parameter (frozen ones too: it must leave them), or
    for "groups" the weights and the biases as two groups with options of their own."""
    if model_name != "groups":
        return model.parameters()
    weights, biases = GROUP_OPTIONS[optimizer]
    return [dict(params=[p for p in model.parameters() if p.dim() == 2], **weights),
            dict(params=[p for p in model.parameters() if p.dim() == 1], **biases)]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in a torch optimizer's state."""
    return sum(v.nbytes for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


@dataclass
class Trained:
    """A run's losses (this rank's), its weights by name at the start and the end, the learning
    rates the inner optimizer stepped with (per step, per inner group) and what it holds."""

    losses: list
    initial: dict
    final: dict
    lrs: list
    state_bytes: int                   # the (inner) optimizer's state tensors
    tracked_state: int = 0             # the same, as a MemoryTracker counts it (labkit's)
    shard: dict = field(default_factory=dict)     # labkit's: numel, shard_numel, padding, ...


def _weights(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _loss(forward, inputs, targets):
    out = forward(inputs)                                       # (rows, 4)
    return F.mse_loss(out, targets.to(out.dtype))


def _train(forward, opt, inner, batches, scheduler: bool) -> tuple[list, list]:
    """STEPS steps on ``batches(step) -> (inputs, targets)``; the losses, and the lrs ``inner``
    (the optimizer that does the arithmetic) stepped with."""
    schedule = StepLR(opt, step_size=1, gamma=0.5) if scheduler else None
    losses, lrs = [], []
    for step in range(STEPS):
        loss = _loss(forward, *batches(step))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        lrs.append([g["lr"] for g in inner.param_groups])
        if schedule is not None:
            schedule.step()
        losses.append(loss.item())
    return losses, lrs


def train(ctx, model_name="mlp", optimizer="adamw", wrapper="labkit", scheduler=False) -> Trained:
    """STEPS steps of ``model_name`` on this rank's rows under ``wrapper`` ("labkit":
    ShardedOptimizer; "torch": ZeroRedundancyOptimizer behind DDP)."""
    model = make_model(model_name)
    initial = _weights(model)
    optimizer_class, defaults = OPTIMIZERS[optimizer]
    params = params_of(model, model_name, optimizer)
    if wrapper == "labkit":
        forward = model
        opt = ShardedOptimizer(params, optimizer_class, ctx.group, **defaults)
        inner = opt.inner
    else:       # imported here: it scripts torch's functional optimizers (66 torch.jit warnings)
        from torch.distributed.optim import ZeroRedundancyOptimizer
        forward = DistributedDataParallel(model, process_group=ctx.group)
        opt = ZeroRedundancyOptimizer(params, optimizer_class, process_group=ctx.group, **defaults)
        inner = opt.optim

    def batches(step):
        return rows("mlp", step, ctx.rank)                      # (4, 8), (4, 4) of its own
    with MemoryTracker(model, opt, timeline=False) as mt:
        losses, lrs = _train(forward, opt, inner, batches, scheduler)
        mt.tag_states()
    trained = Trained(losses, initial, _weights(model), lrs, state_bytes(inner))
    if wrapper == "labkit":
        trained.tracked_state = mt.by_category["optimizer"]
        saved = opt.state_dict()
        trained.shard = dict(numel=opt.numel, shard_numel=opt.shard_numel, padding=opt.padding,
                             unit_numels=[u.numel for u in opt.units],
                             unit_dtypes=[u.flat.dtype for u in opt.units], sent=opt.last_sent,
                             saved_shapes=[tuple(t.shape) for s in saved["inner"]["state"].values()
                                           for t in s.values() if t.dim() > 0])
    return trained


def train_all(ctx, settings: list[dict], misused: bool = False) -> list:
    """``train(ctx, **s)`` for each of ``settings`` in one process group (one start-up: each
    rank's first optimizer imports torch._dynamo, seconds); ``misused``: then ``misuse(ctx)``."""
    return [train(ctx, **s) for s in settings] + ([misuse(ctx)] if misused else [])


def one_process(model_name="mlp", optimizer="adamw", world_size=2, scheduler=False) -> Trained:
    """The same training in one process with the plain optimizer, on all ranks' rows of each step
    concatenated in rank order: what ZeRO-1 must equal (the mean of equal-sized rows' losses)."""
    model = make_model(model_name)
    initial = _weights(model)
    optimizer_class, defaults = OPTIMIZERS[optimizer]
    opt = optimizer_class(params_of(model, model_name, optimizer), **defaults)

    def batches(step):
        parts = [rows("mlp", step, r) for r in range(world_size)]
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])   # (N * 4, ...)
    losses, lrs = _train(model, opt, opt, batches, scheduler)
    return Trained(losses, initial, _weights(model), lrs, state_bytes(opt))


def misuse(ctx) -> dict:
    """What ShardedOptimizer says, on every rank alike, when a parameter gets no gradient, when a
    group is added after it was built, and when a rank loads another rank's state; and whether
    its own state loads back."""
    said = {}
    model = make_model("mlp")
    opt = ShardedOptimizer(model.named_parameters(), torch.optim.AdamW, ctx.group, lr=1e-2)
    x, y = rows("mlp", 0, ctx.rank)
    _loss(model.net[:2], x, torch.zeros(4, HIDDEN, dtype=x.dtype)).backward()  # first layer only
    def add_group():
        opt.add_param_group({"params": [nn.Parameter(x)]})
    for attempt, name in [(opt.step, "no gradient"), (add_group, "add group")]:
        try:
            attempt()
        except ValueError as error:
            said[name] = str(error)
    opt.zero_grad()
    _loss(model, x, y).backward()
    opt.step()
    saved = opt.state_dict()
    other = dict(saved, rank=1 - ctx.rank)
    try:
        opt.load_state_dict(other)
    except ValueError as error:
        said["other rank"] = str(error)
    fresh = ShardedOptimizer(model.parameters(), torch.optim.AdamW, ctx.group, lr=5e-3)
    fresh.load_state_dict(saved)
    said["reloaded lr"] = fresh.param_groups[0]["lr"]
    said["reloaded equal"] = all(torch.equal(a, b) for a, b in
                                 zip(fresh.inner.state[fresh.units[0].master].values(),
                                     opt.inner.state[opt.units[0].master].values()))
    return said
