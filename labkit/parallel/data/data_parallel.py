"""Data parallelism of our own, for any ``nn.Module``: the mechanism of PyTorch's
``DistributedDataParallel`` in one file (Li et al., "PyTorch Distributed", VLDB 2020;
picotron's ``data_parallel/``). ``labkit.parallel.data.ddp`` measures torch's own; the tests
check the two equal.

Every rank holds the whole model and trains it on its own rows. The copies stay equal because
they start equal and every rank steps with the same gradient, the mean over the N ranks:

    wrap        broadcast rank 0's parameters and buffers     ranks may have initialised apart
    backward    as each gradient is ready, launch its         the messages overlap the rest of
                all-reduce (sum) without waiting              the backward pass
    finish()    wait for every all-reduce, then / N           before optimizer.step()

One all-reduce per parameter pays a message's latency once per parameter. With ``bucket_mb``
the gradients are packed, in reverse registration order (about the order backward makes them),
into flat buckets of up to ``bucket_mb`` MiB, and a bucket is all-reduced once all of its
gradients are in:

    param.grad (its shape) --copy--> bucket (flat) --all-reduce (sum)--> --/ N, copy--> param.grad

The buckets live as long as the wrapper: one more copy of the gradients (torch's
``gradient_as_bucket_view=True`` makes ``param.grad`` views of them instead, and saves it).

Buckets are launched in their order on every rank - one ready early waits for those before it -
because a collective pairs with the same-numbered collective of the other ranks: ranks that
launched in different orders would add up different gradients. Without buckets each parameter
is a bucket of its own, all-reduced in place in ``param.grad``.

``timeline`` keeps the last step's events (``Event``): when each gradient was ready, when each
all-reduce was launched and when it was done, in seconds from the step's forward pass.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Bucket", "DataParallel", "Event", "broadcast_from_rank0", "make_buckets"]

MIB = 2 ** 20
KINDS = ("forward", "ready", "launch", "done", "finish")


@dataclass
class Event:
    """One moment of a step: ``seconds`` since its forward pass began, what happened, to whom."""

    seconds: float
    kind: str                      # one of KINDS
    names: tuple[str, ...]         # the parameters concerned (a bucket's, for launch and done)


class Bucket:
    """Parameters whose gradients travel as one all-reduce. ``flat`` (their elements,) holds
    the gradients end to end; ``flat=None``: one parameter, all-reduced in its own ``.grad``."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], flat: bool):
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.flat, self.views = None, {}
        if flat:
            first = self.params[0]
            self.flat = torch.zeros(sum(p.numel() for p in self.params), dtype=first.dtype,
                                    device=first.device)
            offset = 0
            for p in self.params:              # the views never move: the bucket lives on
                self.views[p] = self.flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        self.arrived: set[nn.Parameter] = set()     # gradients in, this step

    def is_full(self) -> bool:
        return len(self.arrived) == len(self.params)

    def message(self) -> torch.Tensor:
        """What is all-reduced: the flat bucket, or the one parameter's gradient."""
        return self.params[0].grad if self.flat is None else self.flat


def make_buckets(named_params: list[tuple[str, nn.Parameter]],
                 bucket_mb: float | None) -> list[Bucket]:
    """Cut ``named_params``, in their order, into buckets of at most ``bucket_mb`` MiB (one
    parameter larger than that: a bucket of its own), one dtype and device each.
    ``bucket_mb=None``: one unflattened bucket per parameter."""
    if bucket_mb is None:
        return [Bucket([pair], flat=False) for pair in named_params]
    cap, buckets, current = bucket_mb * MIB, [], []
    for name, p in named_params:
        size = sum(q.nbytes for _, q in current)
        if current and (size + p.nbytes > cap or (p.dtype, p.device) != (current[0][1].dtype,
                                                                          current[0][1].device)):
            buckets.append(Bucket(current, flat=True))
            current = []
        current.append((name, p))
    if current:
        buckets.append(Bucket(current, flat=True))
    return buckets


def broadcast_from_rank0(module: nn.Module, group) -> None:
    """Give every rank of ``group`` its rank 0's parameters and buffers, in place (frozen ones
    too; a tied weight once)."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.detach(), group_src=0, group=group)


class DataParallel(nn.Module):
    """``module`` trained on N ranks of ``group``, each on its own rows, its copies kept equal.

    At wrap every rank takes rank 0's parameters and buffers. In each backward pass a hook per
    trainable parameter (``register_post_accumulate_grad_hook``) launches the all-reduce of its
    gradient, or of its bucket once full (``bucket_mb`` MiB, None: one per parameter), without
    waiting. ``finish()`` waits for them and divides by N: call it after ``backward()`` and
    before ``optimizer.step()``, which would otherwise step on sums still in flight::

        model = DataParallel(net, ctx.group, bucket_mb=25)
        optimizer = torch.optim.AdamW(model.parameters())
        loss = loss_fn(model(x), y)        # x, y: this rank's rows
        loss.backward()                    # all-reduces launched as gradients appear
        model.finish(); optimizer.step(); optimizer.zero_grad()

    (or ``model.finish_before(optimizer)`` once, and ``optimizer.step()`` calls it.)

    Frozen parameters (``requires_grad=False``) are broadcast, never all-reduced. A tied weight
    (one parameter reached from two modules) is one parameter: its hook runs once, after both
    uses have added to its gradient, and it is all-reduced once. A parameter that gets no
    gradient in a step makes ``finish()`` raise, naming it, unless
    ``find_unused_parameters=True``: then it counts as a zero gradient from this rank (its
    gradient becomes the others' sum / N) and its bucket, and every bucket after it, is
    launched in ``finish()``; a parameter no rank used keeps no gradient (``None``), as in one
    process - one more small all-reduce, of which parameters each rank used. Buffers are not
    sent again after the wrap (torch's ``broadcast_buffers`` sends rank 0's before each forward).
    """

    def __init__(self, module: nn.Module, group, bucket_mb: float | None = None,
                 find_unused_parameters: bool = False):
        super().__init__()
        if bucket_mb is not None and (isinstance(bucket_mb, bool)
                                      or not isinstance(bucket_mb, (int, float))
                                      or not bucket_mb > 0):
            raise ValueError(f"bucket_mb must be a positive number of MiB, or None for one "
                             f"all-reduce per parameter, got {bucket_mb!r}")
        self.module, self.group = module, group
        self.world = dist.get_world_size(group=group)
        self.find_unused_parameters = find_unused_parameters
        broadcast_from_rank0(module, group)
        # named_parameters lists a tied weight once, under its first name
        trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.buckets = make_buckets(trainable[::-1], bucket_mb)     # backward's order, roughly
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self._name = {p: n for n, p in trainable}
        self.timeline: list[Event] = []        # the last step's events, for a plot
        self._sync, self._t0 = True, None
        self._works: list = []                 # (work, its done-note future), launch order
        self._next = 0                         # the next bucket to launch
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for _, p in trainable]

    def forward(self, *args, **kwargs):
        self._note("forward")
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside add their gradients up locally, sending nothing; the next
        backward outside all-reduces the sum (gradient accumulation, as torch's ``no_sync``)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # ---- in the backward pass ------------------------------------------------------------
    def _on_grad_ready(self, p: nn.Parameter):
        """``p.grad`` is final for this backward: put it in its bucket, launch what is full."""
        if not self._sync:
            return
        bucket = self._bucket_of[p]
        if p in bucket.arrived:
            raise RuntimeError(f"{self._name[p]}'s gradient arrived twice before finish(): call "
                               "finish() after each backward, or accumulate inside no_sync()")
        self._note("ready", self._name[p])
        if bucket.flat is not None:
            bucket.views[p].copy_(p.grad)
        bucket.arrived.add(p)
        self._launch_full_buckets()

    def _launch_full_buckets(self):
        """Launch buckets in their order, as far as they are full (every rank the same order)."""
        while self._next < len(self.buckets) and self.buckets[self._next].is_full():
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: Bucket):
        work = dist.all_reduce(bucket.message(), group=self.group, async_op=True)
        self._note("launch", *bucket.names)
        # the done note comes from the communication thread, as the all-reduce ends
        timeline, t0 = self.timeline, self._t0
        done = work.get_future().then(
            lambda _: timeline.append(Event(time.perf_counter() - t0, "done", tuple(bucket.names))))
        self._works.append((work, done))

    def finish_before(self, optimizer):
        """Call ``finish()`` at the start of every ``optimizer.step()`` (a step pre-hook), for a
        training loop that does not know about the wrapper. Returns the hook's handle."""
        return optimizer.register_step_pre_hook(lambda *_: self.finish())

    # ---- after the backward pass -------------------------------------------------------------
    def finish(self):
        """Wait for this step's all-reduces and average: every ``param.grad`` becomes the mean
        over the ranks. Call after ``backward()``, before ``optimizer.step()``."""
        if not self._sync:
            raise RuntimeError("finish() inside no_sync(): nothing was sent; call it after the "
                               "backward pass outside the block")
        missing = [p for b in self.buckets for p in b.params if p not in b.arrived]
        if missing and not self.find_unused_parameters:
            names = ", ".join(self._name[p] for p in missing)
            raise RuntimeError(f"no gradient reached {names} in this step: a parameter the loss "
                               "does not depend on (or finish() before backward()); use "
                               "DataParallel(..., find_unused_parameters=True), or freeze it")
        used = None
        if self.find_unused_parameters:
            for p in missing:                  # a zero share of the sum from this rank
                bucket = self._bucket_of[p]
                if bucket.flat is None:
                    p.grad = torch.zeros_like(p)
                else:
                    bucket.views[p].zero_()
                bucket.arrived.add(p)
            self._launch_full_buckets()
            # (parameters,) 1 where this rank made a gradient; summed: how many ranks did
            unused_here = set(missing)         # a set: ``in`` on a list compares tensors
            used = torch.tensor([p not in unused_here for p in self._name], dtype=torch.int32)
            dist.all_reduce(used, group=self.group)
        for work, done in self._works:
            work.wait()
            done.wait()                        # its note is in the timeline
        for bucket in self.buckets:
            bucket.message().div_(self.world)
            for p in bucket.params if bucket.flat is not None else ():
                if p.grad is None:             # unused here, used by another rank
                    p.grad = bucket.views[p].clone()
                else:
                    p.grad.copy_(bucket.views[p])
        if used is not None:
            for p, count in zip(self._name, used.tolist()):
                if count == 0:                 # no rank used it: no gradient, as one process
                    p.grad = None
        self._note("finish")
        for bucket in self.buckets:
            bucket.arrived.clear()
        self._works, self._next, self._t0 = [], 0, None

    def _note(self, kind: str, *names: str):
        """Add an event to the timeline; the first of a step starts a new timeline."""
        now = time.perf_counter()
        if self._t0 is None:
            self.timeline, self._t0 = [], now
        self.timeline.append(Event(now - self._t0, kind, names))
