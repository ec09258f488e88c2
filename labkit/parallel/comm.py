"""A process group and the bytes this rank sent on it: the collectives every parallelism of
labkit calls (tensor, sequence, context and expert parallelism, ZeRO's sharded optimizer), counted.
``CommCounter`` also fits ``labkit.parallel.data.zero_step``'s calls (the same signatures)."""
from __future__ import annotations

import math
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

RELEASE_WAIT_S = 0.1      # how long a collective waits for gloo's worker to let go of its tensors


class CommCounter:
    """A process group and the bytes this rank sent on it, per collective (``sent``).

    Ring algorithms: an all-reduce of n bytes sends 2 (N - 1) / N * n from every rank (a
    reduce-scatter then an all-gather); an all-gather into, or a reduce-scatter from, a buffer
    of n bytes sends (N - 1) / N * n.

    gloo's worker thread lets go of a collective's tensors a moment after the collective
    returns: a tensor the caller drops at once is then freed by that thread, at a time that
    varies from run to run. Each collective here waits until the worker has let go (CPU tensors
    only), so that a memory tracker sees every free at the same point in every run.
    """

    def __init__(self, group, world: int | None = None, rank: int | None = None):
        self.group = group
        self.world = dist.get_world_size(group=group) if world is None else world
        self.rank = dist.get_rank(group=group) if rank is None else rank
        self.sent = Counter()          # collective -> bytes this rank sent since the last reset

    def all_reduce(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Sum (or ``op``) ``x`` over the ranks, in place."""
        self._run(lambda alias: dist.all_reduce(alias, op=op, group=self.group), x)
        self.sent["all_reduce"] += 2 * (self.world - 1) * x.nbytes // self.world
        return x

    def all_gather(self, full: torch.Tensor, mine: torch.Tensor):
        """Every rank's ``mine`` (k, ...), in rank order, into ``full`` (N * k, ...)."""
        self._run(lambda full, mine: dist.all_gather_single(full, mine, group=self.group),
                  full, mine)
        self.sent["all_gather"] += (self.world - 1) * mine.nbytes

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor):
        """Sum ``full`` (N * k, ...) over the ranks; ``out`` gets this rank's (k, ...) slice."""
        # the list form: gloo's reduce_scatter_single makes a copy of ``full`` that its worker
        # thread frees, at a time that varies
        self._run(lambda out, full: dist.reduce_scatter(out, list(full.chunk(self.world)),
                                                        group=self.group), out, full)
        self.sent["reduce_scatter"] += (self.world - 1) * out.nbytes

    def all_to_all(self, x, send: list[int], recv: list[int], name: str = "all_to_all"):
        """``all_to_all_single`` with split sizes: the first send[0] rows of x go to rank 0, the
        next send[1] to rank 1, ...; returns the recv[r] rows from each rank r, in rank order."""
        out = x.new_empty(sum(recv), *x.shape[1:])                            # (sum(recv), ...)
        def all_to_all(out, x):
            dist.all_to_all_single(out, x, recv, send, group=self.group)

        if isinstance(x, FakeTensor):         # a fake group: no worker thread holds the tensors
            all_to_all(out, x)
        else:                                 # on until gloo's worker has let go of them
            self._run(all_to_all, out, x.contiguous())
        self.sent[name] += (sum(send) - send[self.rank]) * math.prod(x.shape[1:]) * x.itemsize
        return out

    def exchange(self, x: torch.Tensor, to: int, source: int, name: str, tag: int = 0):
        """Send ``x`` to rank ``to`` while a tensor like it arrives from ``source`` (ranks in the
        group), without waiting: ``.wait()`` on the result returns what arrived. A ring passes
        blocks this way, each rank to the next, while it computes on the block it holds."""
        if to == source == self.rank:                 # a ring of one: nothing travels
            return _Pending(self, [], (x, x), [])
        received = torch.empty_like(x)
        uses = [_storage_uses(x), _storage_uses(received)]
        # one batch, so NCCL pairs the send and the receive (two ranks sending to each other
        # first would wait for ever); aliases, as in ``_run``: gloo's worker holding them shows
        # in the storages' use counts
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, x.view_as(x), group=self.group, group_peer=to, tag=tag),
            dist.P2POp(dist.irecv, received.view_as(received), group=self.group,
                       group_peer=source, tag=tag)])
        self.sent[name] += x.nbytes
        return _Pending(self, works, (x, received), uses)

    def _run(self, collective, *tensors):
        """``collective`` on aliases of ``tensors``; then, on the CPU (gloo), wait until its
        worker thread has dropped them: no more tensors on their storages than before."""
        uses = [_storage_uses(t) for t in tensors]
        collective(*(t.view_as(t) for t in tensors))
        self._released(tensors, uses)

    @staticmethod
    def _released(tensors, uses):
        """On the CPU (gloo), wait until no more tensors share ``tensors``' storages than
        ``uses``: the worker thread has let go of them."""
        if tensors[0].device.type != "cpu":
            return
        deadline = time.monotonic() + RELEASE_WAIT_S
        while (any(_storage_uses(t) > n for t, n in zip(tensors, uses))
               and time.monotonic() < deadline):
            time.sleep(0)

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    def reset(self):
        self.sent.clear()


class _Pending:
    """A point-to-point exchange in flight: ``wait()`` returns the tensor received."""

    def __init__(self, comm: CommCounter, works, tensors, uses):
        self.comm, self.works, self.tensors, self.uses = comm, works, tensors, uses

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        self.comm._released(self.tensors, self.uses)
        received = self.tensors[1]
        self.tensors = ()
        return received


class AllToAll(torch.autograd.Function):
    """``CommCounter.all_to_all`` in the forward pass; the gradients travel back reversed."""

    @staticmethod
    def forward(ctx, x, send, recv, comm, name):
        ctx.route = (send, recv, comm, name)
        return comm.all_to_all(x, send, recv, name)

    @staticmethod
    def backward(ctx, grad):
        send, recv, comm, name = ctx.route
        return comm.all_to_all(grad, recv, send, f"{name} (backward)"), None, None, None, None


def _storage_uses(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s storage (an alias held by a worker thread counts)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)
