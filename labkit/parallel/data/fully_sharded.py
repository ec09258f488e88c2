"""Fully sharded data parallelism of our own, for any ``nn.Module``: ZeRO-3's mechanism
(Rajbhandari et al., 2020) as PyTorch's FSDP2 (``fully_shard``) lays it out, in one file.
``labkit.parallel.data.fsdp`` measures torch's own; the tests check the two equal.

Every rank keeps 1/N of each parameter: its dim 0 cut into N equal chunks (the last padded
with zeros), as FSDP2 does. The chunk is the rank's ``nn.Parameter``, under the original name,
so any torch optimizer steps it and its ``.grad`` is the gradient's chunk. A whole weight
exists only while a unit computes with it:

1. A unit's forward all-gathers its weights, each cast to the compute dtype first (fewer
   bytes): chunks (N, rows / N, ...) -> the weight (rows, ...). They are dropped when the
   unit's forward ends; autograd keeps a note of each weight it saved instead.
2. The backward pass all-gathers a unit's weights again when autograd unpacks a note, one
   unit at a time.
3. Each weight's gradient is reduce-scattered when autograd reaches the weight's gather, after
   the unit's other backward work (the gather is older), one weight at a time: summed over
   the ranks, / N, into the chunk's ``.grad`` in the parameter's dtype. One collective per
   weight, none overlapped with compute: FSDP2 sends one per unit, in flat buffers, and
   overlaps them.

Units come from ``units``: module classes or a predicate (each transformer block, say). What
no unit holds belongs to the root, gathered for the whole forward. ``replicate`` keeps chosen
parameters whole on every rank (small ones: norms), their gradients all-reduced. A weight two
units share (tied embeddings) is gathered by each and its two gradients summed; FSDP2 asks
for both users in one unit instead. ``full_state_dict()`` gathers every weight by its name.
``replica_group`` makes it HSDP: shard inside ``group`` (a node), replicate across the groups,
each chunk's gradient all-reduced over the replicas after its reduce-scatter.

Notes come from ``torch.autograd.graph.saved_tensors_hooks``: an op's saved weight (or a view
of it) is packed as (parameter, size, stride, offset) and gathered again when unpacked; the
wrapper's hooks replace any outer ones (``save_on_cpu``) inside it. Under autocast without
``compute_dtype``, ops save autocast's 16-bit copies instead, which live until the backward
pass: pass ``compute_dtype`` (FSDP's ``param_dtype``).

What it asks of the model, as FSDP2 does of its units:

- Every rank uses the same parameters in the same order. A branch taken on some ranks only
  pairs one parameter's collectives with another's (DDP's ``find_unused_parameters`` has no
  counterpart here).
- A parameter is whole only inside its unit's forward: read elsewhere, it is the chunk. Wrap
  ``torch.utils.checkpoint`` around whole units, not inside one.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_map

from labkit.parallel.comm import CommCounter
from labkit.parallel.data.data_parallel import broadcast_from_rank0

__all__ = ["FullyShardedDataParallel"]


class _Comms:
    """What the wrapper's parameters share: the shards' group and the replicas' (HSDP), counted
    by ``CommCounter`` into one tally (``sent``), and whether gradients are reduced now."""

    def __init__(self, group, replicas=None):
        self.shard = CommCounter(group)
        self.replicas = CommCounter(replicas) if replicas is not None else None
        self.replica_count = self.replicas.world if self.replicas else 1
        if self.replicas:
            self.replicas.sent = self.shard.sent            # one tally for the wrapper
        self.sync, self.sent = True, self.shard.sent

    def across_replicas(self, t: torch.Tensor):
        """Sum ``t`` over the replicas (HSDP: the ranks that hold the same shards), in place."""
        if self.replicas:
            self.replicas.all_reduce(t)


class _Sharded:
    """One parameter as this rank keeps it: ``shard``, its chunk of dim 0 (rows / N, ...), and
    under ``no_sync`` its whole gradient summed so far (``unsynced``)."""

    def __init__(self, name: str, param: nn.Parameter, compute_dtype, comms: _Comms):
        self.name, self.shape, self.comms = name, param.shape, comms
        self.unsynced: torch.Tensor | None = None
        self.world, rank = comms.shard.world, comms.shard.rank
        self.compute_dtype = compute_dtype
        rows = -(-param.shape[0] // self.world)                      # rows per rank, rounded up
        chunk = torch.zeros((rows, *param.shape[1:]), dtype=param.dtype, device=param.device)
        mine = param.detach()[rank * rows:(rank + 1) * rows]
        chunk[:len(mine)] = mine
        self.shard = nn.Parameter(chunk, requires_grad=param.requires_grad)
        self.unit: _Unit | None = None          # the first unit that uses it: regathered with it

    def gather(self, dtype=None) -> torch.Tensor:
        """The whole weight, of the parameter's shape, from every rank's chunk, in ``dtype``
        (default: the compute dtype, else the parameter's); a collective."""
        mine = self.shard.detach().to(dtype or self.compute_dtype or self.shard.dtype)
        flat = torch.empty(self.world * mine.numel(), dtype=mine.dtype, device=mine.device)
        self.comms.shard.all_gather(flat, mine.contiguous().view(-1))
        return flat[:self.shape.numel()].view(self.shape)              # (N * rows, ...) -> shape

    def scatter(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of the mean over the ranks of ``grad`` (the parameter's shape), in
        the parameter's dtype; a collective."""
        flat = torch.zeros(self.world * self.shard.numel(), dtype=self.shard.dtype,
                           device=grad.device)                         # (N * rows * ...,)
        flat[:grad.numel()] = grad.reshape(-1)
        mine = torch.empty(self.shard.numel(), dtype=flat.dtype, device=flat.device)
        self.comms.shard.reduce_scatter(mine, flat)
        self.comms.across_replicas(mine)
        return mine.div_(self.world * self.comms.replica_count).view_as(self.shard)

    def reduce(self, grad: torch.Tensor) -> torch.Tensor | None:
        """The chunk's gradient: ``grad`` (and what ``no_sync`` held) reduce-scattered; under
        ``no_sync``, None - the whole gradient is summed locally, in the parameter's dtype."""
        if self.unsynced is not None:
            grad = self.unsynced.add_(grad)
        elif not self.comms.sync:
            grad = grad.to(self.shard.dtype, copy=True)
        if not self.comms.sync:
            self.unsynced = grad
            return None
        self.unsynced = None
        return self.scatter(grad)


class _Gather(torch.autograd.Function):
    """A shard -> the whole weight; backward: the weight's gradient reduce-scattered back."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, sharded: _Sharded) -> torch.Tensor:
        ctx.sharded = sharded
        return sharded.gather()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.sharded.reduce(grad), None


class _Unit:
    """Modules gathered together: (module, attribute, _Sharded) for each weight they use, and
    (module, attribute, parameter) for each replicated one (cast to the compute dtype)."""

    def __init__(self, name: str):
        self.name, self.uses, self.replicated = name, [], []

    def sharded(self) -> list[_Sharded]:
        return list(dict.fromkeys(s for _, _, s in self.uses))


def _storage(t: torch.Tensor) -> int | None:
    """Where ``t``'s elements live (a dense tensor with some), else None."""
    if t.layout != torch.strided or t.numel() == 0:
        return None
    return t.untyped_storage().data_ptr()


def _unit_predicate(units) -> Callable[[nn.Module], bool]:
    """``units`` as a predicate on modules; ValueError for anything else."""
    if units is None:
        return lambda module: False
    if callable(units) and not isinstance(units, type):
        return units
    classes = (units,) if isinstance(units, type) else tuple(units)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise ValueError(f"units are nn.Module classes (e.g. (TransformerBlock,)) or a "
                         f"predicate module -> bool, got {units!r}")
    return lambda module: isinstance(module, classes)


class FullyShardedDataParallel(nn.Module):
    """``module`` trained on the N ranks of ``group``, each parameter sharded over them.

    At wrap every rank takes rank 0's parameters and buffers and keeps its chunk of each (a
    ``replicate(name, param)`` parameter: whole). Step any torch optimizer over
    ``model.parameters()``; after ``backward()`` every ``.grad`` holds the mean over the ranks.
    HSDP: ``group`` shards (a node's GPUs, say) and ``replica_group`` holds this rank's
    counterparts in the other replicas, over which each reduce-scattered chunk is all-reduced::

        model = FullyShardedDataParallel(net, ctx.group, units=(Block,),
                                         compute_dtype=torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters())
    """

    def __init__(self, module: nn.Module, group=None, *, units=None,
                 replicate: Callable[[str, nn.Parameter], bool] | None = None,
                 compute_dtype: torch.dtype | None = None, replica_group=None):
        super().__init__()
        if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype)
                                              and compute_dtype.is_floating_point):
            raise ValueError(f"compute_dtype is a floating torch.dtype (torch.bfloat16, as "
                             f"FSDP's param_dtype) or None, got {compute_dtype!r}")
        is_unit = _unit_predicate(units)
        self.module, self.group, self.compute_dtype = module, group, compute_dtype
        self._comms = _Comms(group, replica_group)
        self.world = dist.get_world_size(group)
        broadcast_from_rank0(module, group)
        if replica_group is not None:
            broadcast_from_rank0(module, replica_group)
        self._by_param: dict[nn.Parameter, _Sharded] = {}     # the original parameter -> it
        self._by_shard: dict[nn.Parameter, _Sharded] = {}
        self._live: dict[int, _Sharded] = {}                  # storage -> gathered weight's
        self._cache: tuple[_Unit | None, dict] = (None, {})    # the backward's gathered unit
        self._cleanup_queued = False
        self._averaged: set[nn.Parameter] = set()             # replicated, hooked
        self.notes = 0              # weights autograd saved as notes in the last forward
        self.root = _Unit("")
        self.units = [self.root]
        self._assign(module, "", self.root, is_unit, replicate or (lambda name, p: False))
        del self._by_param          # nothing keeps the whole parameters alive after the wrap

    # ---- the wrap ----------------------------------------------------------------------------
    def _assign(self, module: nn.Module, prefix: str, unit: _Unit, is_unit, replicate):
        """Shard ``module``'s own parameters into ``unit``, then its children's (a child that
        ``is_unit`` starts a unit of its own, gathered by hooks around its forward)."""
        for attr, param in list(module._parameters.items()):
            if param is None:
                continue
            name = f"{prefix}{attr}"
            if param.dim() == 0 or replicate(name, param):
                self._replicate(param)
                unit.replicated.append((module, attr, param))
                continue
            if param not in self._by_param:
                sharded = _Sharded(name, param, self.compute_dtype
                                   if param.is_floating_point() else None, self._comms)
                self._by_param[param] = self._by_shard[sharded.shard] = sharded
                sharded.unit = unit
            sharded = self._by_param[param]
            module._parameters[attr] = sharded.shard
            unit.uses.append((module, attr, sharded))
        for child_name, child in module.named_children():
            child_unit = unit
            if is_unit(child):
                child_unit = _Unit(f"{prefix}{child_name}")
                self.units.append(child_unit)
                child.register_forward_pre_hook(self._opener(child_unit), with_kwargs=True)
                child.register_forward_hook(lambda m, args, out, u=child_unit: self._close(u))
            self._assign(child, f"{prefix}{child_name}.", child_unit, is_unit, replicate)

    def _replicate(self, param: nn.Parameter):
        """A whole parameter on every rank: its gradient all-reduced and / N once made."""
        if param.requires_grad and param not in self._averaged:
            self._averaged.add(param)
            param.register_post_accumulate_grad_hook(self._average)

    def _average(self, param: nn.Parameter):
        if self._comms.sync:          # under no_sync, .grad sums this rank's micro-batches
            self._comms.shard.all_reduce(param.grad)
            self._comms.across_replicas(param.grad)
            param.grad.div_(self.world * self._comms.replica_count)

    # ---- gradient accumulation -----------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside keep each weight's whole gradient, summed in the parameter's
        dtype, and reduce nothing; the next backward outside reduce-scatters the sum (FSDP2's
        ``set_requires_gradient_sync(False)``, which sums in ``param_dtype`` unless a
        ``reduce_dtype`` is set): fewer bytes sent, Ψ (1 - 1/N) more elements held per rank.

        The flag is read when backward runs (DDP reads it in the forward). A held sum waits for
        its weight's next synced backward: ``zero_grad`` does not clear it (``drop_unsynced``
        does), and a weight unused in the last micro-batch carries it into a later step."""
        self._comms.sync = False
        try:
            yield
        finally:
            self._comms.sync = True

    def drop_unsynced(self):
        """Forget the gradients ``no_sync`` holds (a skipped step)."""
        for sharded in self._by_shard.values():
            sharded.unsynced = None

    @property
    def sent(self) -> Counter:
        """Bytes this rank sent since it was cleared, by collective (a ring's (N - 1) / N)."""
        return self._comms.sent

    # ---- forward: gather a unit, drop it after --------------------------------------------------
    def _cast(self, args, kwargs):
        """Floating-point inputs in the compute dtype, as FSDP2's ``cast_forward_inputs``."""
        if self.compute_dtype is None:
            return args, kwargs
        cast = lambda x: (x.to(self.compute_dtype) if isinstance(x, torch.Tensor)
                          and x.is_floating_point() else x)
        return tree_map(cast, args), tree_map(cast, kwargs)

    def _opener(self, unit: _Unit):
        def hook(module, args, kwargs):
            self._open(unit)
            return self._cast(args, kwargs)
        return hook

    def _open(self, unit: _Unit):
        gathered = {}
        for module, attr, sharded in unit.uses:
            if sharded not in gathered:
                gathered[sharded] = _Gather.apply(sharded.shard, sharded)
                self._live[_storage(gathered[sharded])] = sharded
            module.__dict__[attr] = gathered[sharded]      # found before module._parameters
        if self.compute_dtype is not None:
            for module, attr, param in unit.replicated:
                if param.is_floating_point():
                    module.__dict__[attr] = param.to(self.compute_dtype)   # grads flow back

    def _close(self, unit: _Unit):
        for module, attr, _ in unit.uses + unit.replicated:
            weight = module.__dict__.pop(attr, None)
            if weight is not None:
                self._live.pop(_storage(weight), None)

    def _reset(self):
        """Nothing gathered, nothing cached: after a forward or backward that raised too."""
        for unit in self.units:
            self._close(unit)
        self._live.clear()
        self._cache, self._cleanup_queued = (None, {}), False

    def forward(self, *args, **kwargs):
        self.notes = 0
        self._reset()
        args, kwargs = self._cast(args, kwargs)
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            self._open(self.root)
            try:
                return self.module(*args, **kwargs)
            finally:
                self._reset()

    # ---- backward: saved weights as notes, gathered again -------------------------------------
    def _pack(self, t: torch.Tensor):
        sharded = self._live.get(_storage(t))
        if sharded is None:
            return t
        self.notes += 1
        return sharded, t.size(), t.stride(), t.storage_offset()

    def _unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        sharded, size, stride, offset = saved
        if sharded not in self._cache[1]:   # one unit at a time: drop the last, gather this one
            self._cache = (None, {})
            with torch.no_grad():
                self._cache = (sharded.unit, {s: s.gather() for s in sharded.unit.sharded()})
            if not self._cleanup_queued:
                # the engine runs it when this backward pass ends (torch's own FSDP does too)
                self._cleanup_queued = True
                Variable._execution_engine.queue_callback(self._end_of_backward)
        return self._cache[1][sharded].as_strided(size, stride, offset)

    def _end_of_backward(self):
        self._cache, self._cleanup_queued = (None, {}), False

    # ---- whole weights ---------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, in its own dtype, and every buffer, by the wrapped module's
        names (``module.state_dict()``'s keys); a collective: every rank calls it."""
        out = {}
        with torch.no_grad():
            for name, t in self.module.state_dict(keep_vars=True).items():
                sharded = self._by_shard.get(t) if isinstance(t, nn.Parameter) else None
                out[name] = (sharded.gather(sharded.shard.dtype) if sharded else t.detach()).clone()
        return out
