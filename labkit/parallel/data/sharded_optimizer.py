"""ZeRO stage 1 (Rajbhandari et al., 2020) for any model and any element-wise torch optimizer:
each of N data-parallel ranks keeps the optimizer state of 1/N of the parameters.

    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, ctx.group, lr=1e-3)
    loss_fn(model(x), y).backward()        # x, y: this rank's rows
    opt.step(); opt.zero_grad()

The trainable parameters of each parameter group, one dtype at a time, become views into one
flat buffer of Ψ elements padded to a multiple of N (``zero_step.FlatShard``, whose share is
``zero.shard``); rank r builds the inner optimizer over its contiguous slice [r Ψ/N, (r+1) Ψ/N)
of each buffer only. ``step()``, per buffer:

    p.grad, each its shape --copy--> bucket (Ψ + padding,) --reduce-scatter (sum), / N-->
        my gradient shard (Ψ/N,) --inner optimizer--> my parameter shard (Ψ/N,)
        --all-gather--> the flat buffer (Ψ + padding,), which the parameters view: the full model

Flat slices (ZeRO's and DeepSpeed's design, as ``labkit.parallel.data.zero_step``), not whole
parameters per rank (torch's ``ZeroRedundancyOptimizer``): every rank holds the state of Ψ/N
elements, rounded up, however uneven the parameters (a greedy split of whole tensors is as
uneven as its largest tensors: an embedding can be most of a model), and the messages are one
reduce-scatter and one all-gather, DDP's 2Ψ (torch's: DDP's all-reduce, then a broadcast from
every rank, 3Ψ). The price: the inner optimizer sees 1-D slices, so it must update each
element from that element's own history. AdamW, Adam, SGD, Adagrad, RMSprop... do; those that
read a whole tensor (Adafactor's row and column moments, Muon's orthogonalisation, LBFGS's line
search, SparseAdam's sparse rows) are refused.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from labkit.parallel.comm import CommCounter
from labkit.parallel.data.zero_step import FlatShard

__all__ = ["NOT_ELEMENTWISE", "ShardedOptimizer"]

# optimizers whose update of an element reads other elements of its tensor (or the whole model)
NOT_ELEMENTWISE = tuple(getattr(torch.optim, name) for name in
                        ("Adafactor", "LBFGS", "Muon", "SparseAdam") if hasattr(torch.optim, name))
NOT_OPTIONS = ("params", "param_names")     # group keys that are not the optimizer's options


def _copy_options(source: dict, target: dict):
    """A parameter group's options (lr, weight_decay, ...) from ``source`` into ``target``."""
    target.update({k: v for k, v in source.items() if k not in NOT_OPTIONS})


class ShardedOptimizer(Optimizer):
    """``optimizer_class`` over this rank's flat shards of ``params`` (ZeRO stage 1).

    ``params``: parameters, or parameter groups (dicts with options of their own), as any torch
    optimizer takes them; frozen ones (``requires_grad=False``) stay out of the shards and never
    change. ``defaults``: the inner optimizer's options. Every rank starts from the same
    parameters (one seed, or ``data_parallel.broadcast_from_rank0``) and runs backward on its
    own rows; ``step()`` averages the gradients over ``group``, steps the inner optimizer on
    this rank's shards, all-gathers the result, and consumes the gradients (every ``p.grad`` is
    None after it, as DeepSpeed's stage 1 frees them). ``param_groups`` hold the caller's
    parameters and options: an LR scheduler changes them, and each step passes them on.
    """

    def __init__(self, params, optimizer_class: type[Optimizer], group, **defaults):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise ValueError(f"optimizer_class={optimizer_class!r} is not a torch.optim.Optimizer "
                             "subclass: pass the class itself, e.g. torch.optim.AdamW")
        if issubclass(optimizer_class, NOT_ELEMENTWISE):
            raise ValueError(f"{optimizer_class.__name__} updates an element from others of its "
                             "tensor, and a rank holds a flat 1-D slice of many tensors: use an "
                             "element-wise optimizer (AdamW, Adam, SGD, Adagrad, RMSprop, ...)")
        if isinstance(params, torch.Tensor):
            raise ValueError("params is one tensor: pass an iterable of parameters "
                             "(model.parameters()) or a list of parameter-group dicts")
        params = list(params)
        if not params:
            raise ValueError("params is empty: pass model.parameters() or a list of "
                             "parameter-group dicts")
        super().__init__(params, defaults)     # torch parses the groups into self.param_groups
        everything = [p for g in self.param_groups for p in g["params"]]
        devices = sorted({str(p.device) for p in everything})
        if len(devices) > 1:
            raise ValueError(f"the parameters are on {', '.join(devices)}: a rank's flat buffer "
                             "lives on one device; move the model there first (model.to(device))")
        if not any(p.requires_grad for p in everything):
            raise ValueError("every parameter is frozen (requires_grad=False): nothing to optimize")
        if not isinstance(group, dist.ProcessGroup):
            raise ValueError(f"group={group!r} is not a torch.distributed ProcessGroup: pass the "
                             "group explicitly (ctx.group under labkit.parallel.cluster.run)")
        self.comm = CommCounter(group)
        self.units = []                # a FlatShard per (parameter group, dtype)
        self._group_of_unit, inner_groups = [], []
        for options in self.param_groups:
            trainable = [p for p in options["params"] if p.requires_grad]
            for dtype in dict.fromkeys(p.dtype for p in trainable):     # in order of appearance
                same = [p for p in trainable if p.dtype == dtype]
                self.units.append(FlatShard(same, self.comm, self.comm.rank, dtype, stage=1))
                self._group_of_unit.append(options)
                inner_groups.append({"params": [self.units[-1].master]})
                _copy_options(options, inner_groups[-1])
        self.inner = optimizer_class(inner_groups, **defaults)
        for ours, inner in self._pairs():  # the class's own defaults (betas, eps, ...) shown here
            _copy_options(inner, ours)
        self.numel = sum(u.numel for u in self.units)                   # Ψ, trainable
        self.shard_numel = sum(u.shard_numel for u in self.units)       # this rank's, padded
        self.padding = sum(u.padding for u in self.units)               # zeros, over all ranks
        self.last_sent = {}            # collective -> bytes this rank sent in the last step

    def _pairs(self):
        """(our group, the inner optimizer's group) per unit: the options pass between them
        (the inner's group dicts are new after a load_state_dict)."""
        return zip(self._group_of_unit, self.inner.param_groups)

    def add_param_group(self, param_group: dict):
        if hasattr(self, "inner"):     # torch's __init__ adds the groups before the shards exist
            raise ValueError("ShardedOptimizer shards its parameter groups when it is built: "
                             "pass every group to the constructor")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        """Average the gradients over the group, step this rank's shards, gather the model."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_gradients()
        for unit in self.units:
            for i, p in enumerate(unit.params):
                unit.put_grad(p, i)    # p.grad --copy--> bucket (Ψ + padding,); p.grad = None
            unit.reduce_grads()        # bucket summed over ranks, / N -> unit.master.grad (Ψ/N,)
        for ours, inner in self._pairs():
            _copy_options(ours, inner)     # what an LR scheduler (or the caller) changed
        self.inner.step()
        for unit in self.units:
            unit.master.grad = None
            unit.stepped(gather=True)  # my (Ψ/N,) -> every rank's (Ψ + padding,)
        self.last_sent = dict(self.comm.sent)
        self.comm.reset()
        return loss

    def _check_gradients(self):
        """Every trainable parameter needs a gradient: a flat shard cannot skip one, as torch's
        optimizers skip a parameter whose .grad is None (and a rank that raises here leaves the
        others waiting in the reduce-scatter: every rank should use every parameter)."""
        for g, ours in enumerate(self.param_groups):
            params = ours["params"]
            names = ours.get("param_names") or [f"parameter {i}" for i in range(len(params))]
            for name, p in zip(names, params):
                if p.requires_grad and p.grad is None:
                    raise ValueError(f"group {g}, {name} {tuple(p.shape)} has no gradient: the "
                                     "flat shards need every trainable parameter's; freeze it "
                                     "(requires_grad=False) if the loss does not use it")
                if p.requires_grad and p.grad.is_sparse:
                    raise ValueError(f"group {g}, {name}: a sparse gradient cannot go into a "
                                     "flat buffer (nn.Embedding(sparse=False))")

    # ---- what this rank holds ---------------------------------------------------------------
    def state_tensors(self) -> list:
        """The inner optimizer's state on this rank: its shards' moments (Ψ/N elements each)
        and scalars (AdamW's step, one per shard)."""
        return [v for s in self.inner.state.values() for v in s.values()
                if isinstance(v, torch.Tensor)]

    def state_bytes(self) -> int:
        return sum(t.nbytes for t in self.state_tensors())

    def memory_tags(self) -> list:
        """(tensor, category) for a ``labkit.MemoryTracker``: the inner state, gradient shards."""
        return ([(t, "optimizer") for t in self.state_tensors()]
                + [(u.master.grad, "grads") for u in self.units if u.master.grad is not None])

    def state_dict(self) -> dict:
        """This rank's shard of the state: the inner optimizer's state_dict (tensors of Ψ/N per
        buffer), with the rank and world size it belongs to."""
        return {"rank": self.comm.rank, "world_size": self.comm.world,
                "inner": self.inner.state_dict()}

    def load_state_dict(self, state_dict: dict):
        """Load a ``state_dict()`` that this rank saved, in a group of the same size."""
        saved = (state_dict["rank"], state_dict["world_size"])
        if saved != (self.comm.rank, self.comm.world):
            raise ValueError(f"this state is rank {saved[0]} of {saved[1]}'s shard; this is rank "
                             f"{self.comm.rank} of {self.comm.world}")
        self.inner.load_state_dict(state_dict["inner"])
        for ours, inner in self._pairs():
            _copy_options(inner, ours)
