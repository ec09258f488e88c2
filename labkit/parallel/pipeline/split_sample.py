"""A popular article's "model parallel" sample, and what splitting a model over two GPUs takes.

The sample puts both layers of ``SplitModel`` on one ``device`` ("GPU0", "GPU1" in its comments
only) and wraps it in DDP: every process holds the whole model, which is data parallelism.
``as_written`` runs it on each rank of a local cluster; ``split_over_ranks`` gives ``part1`` to
rank 0 and ``part2`` to rank 1, sending the activation forward and its gradient back::

    rank 0: x (B, 1024) --part1--> h (B, 512) --send-->
    rank 1:                        h (B, 512) --part2--> y (B, 256) --loss--> backward
    rank 0: h.backward(dh) <--recv-- dh (B, 512) <--send-- rank 1
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

BATCH = 8


class SplitModel(nn.Module):
    """The article's model, its global ``device`` made an argument."""

    def __init__(self, device):
        super().__init__()
        self.device = device
        self.part1 = nn.Linear(1024, 512).to(device)   # the article: "GPU0"
        self.part2 = nn.Linear(512, 256).to(device)    # the article: "GPU1"

    def forward(self, x):
        x = self.part1(x.to(self.device))
        return self.part2(x.to(self.device))            # "moved to the next GPU": the same one


@dataclass
class SplitResult:
    """What one rank held and computed: its parameters' bytes and names, the loss (on the rank
    that has it) and the gradients of the parameters it holds."""

    rank: int
    param_bytes: int
    params: list
    loss: float | None
    grads: dict


def _inputs(device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 1024, generator=g).to(device)           # (B, 1024)


def _result(ctx, model, loss) -> SplitResult:
    held = {name: p for name, p in model.named_parameters() if p.device.type != "meta"}
    return SplitResult(ctx.rank, sum(p.nbytes for p in held.values()), sorted(held),
                       None if loss is None else loss.item(),
                       {name: p.grad.detach().cpu() for name, p in held.items()})


def one_process() -> SplitResult:
    """The model in this process: the loss and gradients the others must equal."""
    torch.manual_seed(0)
    model = SplitModel(torch.device("cpu"))
    loss = model(_inputs(torch.device("cpu"))).square().mean()
    loss.backward()
    return SplitResult(0, sum(p.nbytes for p in model.parameters()),
                       sorted(n for n, _ in model.named_parameters()), loss.item(),
                       {n: p.grad.detach() for n, p in model.named_parameters()})


def as_written(ctx) -> SplitResult:
    """The sample as published, on this rank: ``SplitModel`` on one device, wrapped in DDP."""
    torch.manual_seed(0)
    model = DistributedDataParallel(SplitModel(ctx.device), process_group=ctx.group)
    loss = model(_inputs(ctx.device)).square().mean()
    loss.backward()
    return _result(ctx, model.module, loss)


def split_over_ranks(ctx) -> SplitResult:
    """``part1`` kept on rank 0 and ``part2`` on rank 1; the activation and its gradient cross
    between them. Each rank builds the model from the shared seed (one process's initial weights,
    to compare with) and frees the other part at once (to meta); a real job builds each stage on
    the meta device and loads its own part from a checkpoint, never holding the whole model."""
    if ctx.world_size != 2:
        raise ValueError(f"split_over_ranks splits two layers over 2 ranks, got "
                         f"world_size={ctx.world_size}: run it with cluster.run(fn, 2)")
    torch.manual_seed(0)                       # the same initial weights as one process
    model = SplitModel(ctx.device)
    mine, other = (model.part1, model.part2) if ctx.rank == 0 else (model.part2, model.part1)
    other.to("meta")                           # this rank does not hold the other part
    loss = None
    if ctx.rank == 0:
        h = mine(_inputs(ctx.device))                                   # (B, 512)
        dist.send(h.detach(), dst=1, group=ctx.group)
        dh = torch.empty_like(h)
        dist.recv(dh, src=1, group=ctx.group)                           # (B, 512)
        h.backward(dh)
    else:
        h = torch.empty(BATCH, 512, device=ctx.device)
        dist.recv(h, src=0, group=ctx.group)
        h.requires_grad_(True)
        loss = mine(h).square().mean()                                  # (B, 256) -> ()
        loss.backward()
        dist.send(h.grad, dst=0, group=ctx.group)
    return _result(ctx, model, loss)
