"""What the DataParallel tests run on each rank (spawn imports them by name, so they live here):
small models that are not labkit's, each trained under labkit's DataParallel or torch's DDP."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from labkit.parallel.data.data_parallel import DataParallel

ROWS = 4                   # rows per rank and step


# ---- models that are not labkit's ------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, d_in=8, hidden=16, d_out=4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                                 nn.Tanh(), nn.Linear(hidden, d_out))

    def forward(self, x):               # (rows, d_in) -> (rows, d_out)
        return self.net(x)


class TiedLM(nn.Module):
    """Embedding and output head share one weight (as GPT-2's): one parameter, reached twice."""

    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):          # (rows, T) -> (rows, T, vocab)
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


class FrozenBackbone(nn.Module):
    """A frozen first layer (as a fine-tune's backbone) and a buffer, under a trainable head."""

    def __init__(self, d_in=8, hidden=16, d_out=4):
        super().__init__()
        self.backbone = nn.Linear(d_in, hidden).requires_grad_(False)
        self.register_buffer("scale", torch.rand(hidden) + 0.5)
        self.head = MLP(hidden, hidden, d_out)

    def forward(self, x):
        return self.head(torch.tanh(self.backbone(x)) * self.scale)


class Branchy(nn.Module):
    """Two heads, one used per call, and a layer never used: parameters left without gradient."""

    def __init__(self, d_in=8, hidden=16, d_out=4):
        super().__init__()
        self.trunk = nn.Linear(d_in, hidden)
        self.heads = nn.ModuleList([nn.Linear(hidden, d_out), nn.Linear(hidden, d_out)])
        self.never = nn.Linear(hidden, d_out)

    def forward(self, x, branch: int):
        return self.heads[branch](torch.tanh(self.trunk(x)))


MODELS = {"mlp": MLP, "tied": TiedLM, "frozen": FrozenBackbone, "branchy": Branchy}


def rows(model_name: str, step: int, rank: int, dtype=torch.float64):
    """(inputs, targets) of ``rank`` at ``step``: ROWS rows of its own, the same in any run."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    if model_name == "tied":
        tokens = torch.randint(0, 32, (ROWS, 9), generator=g)      # (rows, T + 1)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(ROWS, 8, generator=g, dtype=dtype), torch.randn(ROWS, 4, generator=g,
                                                                      dtype=dtype)


def loss_of(model_name: str, model, inputs, targets, step: int, rank: int):
    if model_name == "tied":
        logits = model(inputs)                                        # (rows, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    if model_name == "branchy":
        return F.mse_loss(model(inputs, (rank + step) % 2), targets)  # ranks use different heads
    return F.mse_loss(model(inputs), targets)


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)


# ---- one rank's training ---------------------------------------------------------------------
@dataclass
class Trained:
    """A run's losses (this rank's, each micro-batch), its weights as built, after the wrap and at
    the end, by name."""

    losses: list
    built: dict
    initial: dict
    final: dict
    buffers: dict = field(default_factory=dict)
    timeline: list = field(default_factory=list)      # DataParallel's, last step
    launches: list = field(default_factory=list)      # bucket names, launch order, last step


def _weights(module) -> dict:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def train(ctx, model_name="mlp", wrapper="labkit", optimizer="sgd", steps=3, bucket_mb=None,
          differ=False, find_unused=False, accumulate=1, dtype=torch.float64,
          hooked=False) -> Trained:
    """``steps`` steps of ``model_name`` on this rank's rows under ``wrapper`` ("labkit":
    DataParallel, "torch": DistributedDataParallel); ``differ``: each rank initialises with its
    own seed (the wrap must make them equal); ``accumulate`` micro-batches per step, all but the
    last under no_sync(); ``hooked``: labkit's ``finish()`` called by the optimizer's step
    (``finish_before``), not by the loop."""
    torch.manual_seed(ctx.rank if differ else 0)
    net = MODELS[model_name]().to(dtype)
    built = _weights(net)
    if wrapper == "labkit":
        model = DataParallel(net, ctx.group, bucket_mb=bucket_mb,
                             find_unused_parameters=find_unused)
    else:
        model = DistributedDataParallel(net, process_group=ctx.group, bucket_cap_mb=bucket_mb,
                                        find_unused_parameters=find_unused)
    initial = _weights(net)
    opt = make_optimizer(optimizer, [p for p in net.parameters() if p.requires_grad])
    if hooked:
        model.finish_before(opt)
    losses = []
    for step in range(steps):
        for micro in range(accumulate):
            inputs, targets = rows(model_name, step * accumulate + micro, ctx.rank, dtype)
            sync = model.no_sync() if micro < accumulate - 1 else contextlib.nullcontext()
            with sync:
                loss = loss_of(model_name, model, inputs, targets, step, ctx.rank) / accumulate
                loss.backward()
            losses.append(loss.item())
        if wrapper == "labkit" and not hooked:
            model.finish()
        opt.step()
        opt.zero_grad(set_to_none=True)
    timeline = list(model.timeline) if wrapper == "labkit" else []
    buffers = {n: b.clone() for n, b in net.named_buffers()}
    launches = [e.names for e in timeline if e.kind == "launch"]
    return Trained(losses, built, initial, _weights(net), buffers, timeline, launches)


def train_all(ctx, settings: list[dict]) -> list[Trained]:
    """``train(ctx, **s)`` for each of ``settings`` in one process group (one start-up)."""
    return [train(ctx, **s) for s in settings]


def one_process(model_name="mlp", optimizer="sgd", steps=3, world_size=2,
                dtype=torch.float64, accumulate=1) -> Trained:
    """The same training in one process on all ranks' rows of each step (``accumulate``
    micro-batches of them), concatenated in rank order: what data parallelism must equal (the
    mean of equal-sized rows' losses)."""
    torch.manual_seed(0)
    net = MODELS[model_name]().to(dtype)
    initial = _weights(net)
    opt = make_optimizer(optimizer, [p for p in net.parameters() if p.requires_grad])
    losses = []
    for step in range(steps):
        for micro in range(accumulate):
            parts = [rows(model_name, step * accumulate + micro, r, dtype)
                     for r in range(world_size)]
            inputs = torch.cat([x for x, _ in parts])              # (N * rows, ...)
            targets = torch.cat([y for _, y in parts])
            loss = loss_of(model_name, net, inputs, targets, step, 0) / accumulate
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return Trained(losses, initial, initial, _weights(net))


def misuse(ctx) -> list[str]:
    """What DataParallel says, on every rank alike, when a gradient is missing and when
    backward runs twice before finish()."""
    said = []
    torch.manual_seed(0)
    model = DataParallel(Branchy().double(), ctx.group)
    inputs, targets = rows("branchy", 0, 0)
    F.mse_loss(model(inputs, 0), targets).backward()
    try:
        model.finish()
    except RuntimeError as error:
        said.append(str(error))
    model = DataParallel(MLP().double(), ctx.group)
    F.mse_loss(model(inputs), targets).backward()
    try:
        F.mse_loss(model(inputs), targets).backward()
    except RuntimeError as error:
        said.append(str(error))
    model.finish()                       # the first backward's all-reduces, still ours to wait
    return said
