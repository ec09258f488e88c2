"""PyTorch's own ZeRO beside labkit's: ZeroRedundancyOptimizer (stage 1) and FSDP2 (stage 3).

Five rank functions train the same model on the same rows with the same AdamW and return each
rank's ``ShardStep`` (losses, the tracker's peak by category, what the rank holds after);
``side_by_side`` runs them all on one cluster:

    zero_redundancy_step   torch's ZeroRedundancyOptimizer (stage 1), gradients all-reduced
                           in place, or (``under_ddp``) by torch's DDP, in buckets
    fsdp2_step             torch's FSDP2, ``fully_shard`` on each block, then on the root
    labkit_zero_step       labkit's ``ZeroOptimizer``, stage 1, 2 or 3 (``zero_step``)
    labkit_fsdp_step       labkit's ``FullyShardedDataParallel`` (``fully_sharded``), a unit per
                           block, torch's AdamW over its chunks
    labkit_sharded_optimizer_step  labkit's ``ShardedOptimizer`` (``sharded_optimizer``): stage 1
                           over torch's AdamW, in flat slices

ZeroRedundancyOptimizer gives each rank whole parameters (a greedy split by size), not a flat
slice: its ranks hold different optimizer-state bytes. FSDP2 splits every parameter along
dim 0 (``torch.chunk``, padded to N equal chunks) and all-gathers a block's parameters before
its forward and again before its backward; the root's (embedding, final norm, LM head) stay
gathered from the start of the forward to the end of the backward. A rank holds its shards,
the root and the block being computed - and in the backward pass one more: FSDP2 prefetches
the next block's all-gather as each block's backward starts (labkit's stage 3 gathers one at
a time, and so does the estimate: one block below FSDP2). The tracker counts a DTensor by its
local shard and FSDP2's gathered parameters (freed with ``resize_(0)``) as parameters
(``FSDP2Parameters``).

At full scale ``fake_fsdp2_peak`` runs one FSDP2 step of a 7B or MoE model on fake tensors
under a fake process group (this process plays one rank of N; collectives do nothing), and
``fake_fsdp2_scaling`` sweeps N beside ``labkit.estimate(zero_stage=3)``: the model states
16 Psi / N shrink with N (ZeRO, Table 1) until the activations, which do not, dominate
(``labkit.course.plot.scaling_figure``).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

from labkit.core.config import preset
from labkit.core.units import CATEGORIES, check_choice, torch_dtype
from labkit.parallel.data.data_parallel import DataParallel
from labkit.parallel.data.ddp import BucketLog, allreduce_and_tag
from labkit.parallel.data.fully_sharded import FullyShardedDataParallel
from labkit.parallel.data.sharded_optimizer import ShardedOptimizer
from labkit.parallel.data.zero_step import node_groups, train_zero  # noqa: F401 (re-exported)
from labkit.parallel.steps import RankStep, measure_rank, rank_tokens
from labkit.training.step import make_optimizer, train_step
from labkit.training.track import MemoryTracker
from labkit.transformer.model import Block, build_model

# labkit's ZeroOptimizer defaults (its inner AdamW is a for-loop), with the lab's learning rate
ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, foreach=False)
WORLDS = tuple(2 ** k for k in range(3, 11))        # 8, 16, ..., 1024 ranks
FAKE_PRECISIONS = ("fp32", "bf16", "bf16-master", "bf16-mixed")


@dataclass
class ShardStep(RankStep):
    """A ``RankStep`` and what the rank holds after the last step, from its own tensors."""

    param_bytes: int = 0        # its parameters' storages (FSDP2: local shards, padded)
    state_bytes: int = 0        # AdamW's exp_avg and exp_avg_sq on this rank
    grads_at_step: int = 0      # "grads" bytes counted as the last optimizer step began


def _held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor's: its local shard's)."""
    storages = {}
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _state_bytes(optimizer) -> int:
    """AdamW's two moments on this rank (exp_avg, exp_avg_sq), local shards only."""
    return _held_bytes(s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")
                       if k in s)


def _seeded_model(model_name: str, device) -> torch.nn.Module:
    """The same initial weights on every rank and in every wrapper."""
    torch.manual_seed(0)
    return build_model(preset(model_name), device=device)


# ---- FSDP2 ------------------------------------------------------------------------------------
def even_placement(world_size: int):
    """FSDP2 splits every parameter along dim 0, padded to N equal chunks: a tensor of 64
    experts over 1024 ranks leaves 960 ranks empty and gathers 16x its size. This placement
    keeps dim 0 when it has at least N rows, else takes the widest dimension N divides
    (FSDP2 shards any other dimension only evenly)."""
    def place(p):
        if p.shape[0] >= world_size:
            return Shard(0)
        even = [d for d in range(1, p.ndim) if p.shape[d] % world_size == 0]
        return Shard(max(even, key=lambda d: p.shape[d])) if even else Shard(0)
    return place


PLACEMENTS = ("dim0", "even")


def shard_blocks(model, mesh: DeviceMesh, reshard_after_forward: bool = True,
                 placement: str = "dim0", param_dtype: torch.dtype | None = None) -> list:
    """``fully_shard`` each block of ``model.blocks``, then the root (embedding, final norm,
    LM head); returns the FSDP modules, blocks first. A block is one all-gather.
    ``placement``: "dim0" (FSDP2's default) or "even" (``even_placement``). ``param_dtype``:
    FSDP2's ``MixedPrecisionPolicy``, shards cast to it before the all-gather, gradients
    reduced in fp32."""
    check_choice("placement", placement, PLACEMENTS)
    place = even_placement(mesh.size()) if placement == "even" else None
    policy = dict(mp_policy=MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None))
    for module in model.blocks:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=place, **policy)
    # the root keeps FSDP2's default: gathered from its forward to its backward
    fully_shard(model, mesh=mesh, reshard_after_forward=None, shard_placement_fn=place,
                **policy)
    return [*model.blocks, model]


class FSDP2Parameters:
    """What the tracker counts as FSDP2's parameters: each sharded parameter (a DTensor, its
    local shard) and each unsharded one FSDP2 all-gathers into and frees (``resize_(0)``) after
    use; and the model's buffers. Gathers once to find the unsharded ones, which FSDP2 keeps."""

    def __init__(self, model, fsdp_modules: list):
        for module in fsdp_modules:
            module.unshard()                     # swaps in the unsharded (full) parameters
        self.gathered = list(model.parameters())
        for module in fsdp_modules:
            module.reshard()                     # back to shards; their storages resize to 0
        self.sharded = list(model.parameters())
        self._buffers = list(model.buffers())

    def parameters(self):
        return iter(self.sharded + self.gathered)

    def buffers(self):
        return iter(self._buffers)


# ---- the rank functions ---------------------------------------------------------------------
def zero_redundancy_step(ctx, model_name: str = "tiny", batch: int = 1, seq: int = 32,
                         steps: int = 3, under_ddp: bool = False) -> ShardStep:
    """torch's ``ZeroRedundancyOptimizer`` (stage 1): each rank steps AdamW on the whole
    parameters it owns, then broadcasts them. Gradients are averaged by labkit's
    ``DataParallel`` without buckets (an all-reduce per parameter, in place); ``under_ddp``:
    by torch's ``DistributedDataParallel`` instead, its normal use, whose buckets (a copy of
    the gradients, G) the tracker counts as gradients (``ddp.allreduce_and_tag``)."""
    model = _seeded_model(model_name, ctx.device)
    log = BucketLog(ctx.group)
    if under_ddp:
        averaged = DistributedDataParallel(
            model, device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
            process_group=ctx.group)
        averaged.register_comm_hook(log, allreduce_and_tag)
    else:
        averaged = DataParallel(model, ctx.group)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                  process_group=ctx.group, **ADAMW)
    opt.optim.register_step_pre_hook(lambda *_: log.note("optimizer"))
    if not under_ddp:
        averaged.finish_before(opt)
    batches = rank_tokens(ctx, model.cfg.vocab_size, batch, seq, steps)
    step = measure_rank(ctx, model, averaged, opt, batches, states=opt.optim)
    return ShardStep(**vars(step), param_bytes=_held_bytes(model.parameters()),
                     state_bytes=_state_bytes(opt.optim), grads_at_step=log.held["optimizer"])


def fsdp2_step(ctx, model_name: str = "tiny", batch: int = 1, seq: int = 32, steps: int = 3,
               reshard_after_forward: bool = True) -> ShardStep:
    """torch's FSDP2 over ``ctx.group``: parameters, gradients and AdamW's state sharded
    (stage 3); ``reshard_after_forward=False`` keeps each block gathered until its backward."""
    model = _seeded_model(model_name, ctx.device)
    mesh = DeviceMesh.from_group(ctx.group, ctx.device.type)
    tracked = FSDP2Parameters(model, shard_blocks(model, mesh, reshard_after_forward))
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    batches = rank_tokens(ctx, model.cfg.vocab_size, batch, seq, steps)
    step = measure_rank(ctx, tracked, model, opt, batches)
    return ShardStep(**vars(step), param_bytes=_held_bytes(model.parameters()),
                     state_bytes=_state_bytes(opt))


def labkit_zero_step(ctx, stage: int, model_name: str = "tiny", batch: int = 1, seq: int = 32,
                     steps: int = 3) -> ShardStep:
    """labkit's ``ZeroOptimizer`` at ``stage`` 1, 2 or 3 (``zero_step``: flat padded shards,
    fp32, the same AdamW as ``ADAMW``), with what the rank holds after the steps."""
    step, model, opt = train_zero(ctx, stage, model_name, batch, seq, steps, "fp32",
                                  lr=ADAMW["lr"])
    masters = [p for group in opt.inner.param_groups for p in group["params"]]
    return ShardStep(**vars(step), param_bytes=_held_bytes([*model.parameters(), *masters]),
                     state_bytes=_state_bytes(opt.inner))


def labkit_fsdp_step(ctx, model_name: str = "tiny", batch: int = 1, seq: int = 32,
                     steps: int = 3, nodes: int = 1) -> ShardStep:
    """labkit's ``FullyShardedDataParallel`` with each block a unit, stepped by torch's AdamW
    over its chunks (``ADAMW``), with what the rank holds after the steps and the bytes it
    sent per step. ``nodes`` > 1: HSDP, sharded inside each node, replicated across."""
    model = _seeded_model(model_name, ctx.device)
    group, replicas = node_groups(ctx, nodes) if nodes > 1 else (ctx.group, None)
    sharded = FullyShardedDataParallel(model, group, units=(Block,), replica_group=replicas)
    opt = torch.optim.AdamW(sharded.parameters(), **ADAMW)
    batches = rank_tokens(ctx, model.cfg.vocab_size, batch, seq, steps)
    step = measure_rank(ctx, sharded, sharded, opt, batches)
    step.sent = {kind: sent // steps for kind, sent in sharded.sent.items()}   # steps are alike
    return ShardStep(**vars(step), param_bytes=_held_bytes(sharded.parameters()),
                     state_bytes=_state_bytes(opt))


def fsdp_and_hsdp(ctx, model_name: str = "small", seq: int = 64) -> dict:
    """labkit's FSDP over every rank, and HSDP over two nodes: {"FSDP": ..., "HSDP": ...}."""
    return {"FSDP": labkit_fsdp_step(ctx, model_name, 1, seq),
            "HSDP": labkit_fsdp_step(ctx, model_name, 1, seq, nodes=2)}


def labkit_sharded_optimizer_step(ctx, model_name: str = "tiny", batch: int = 1, seq: int = 32,
                                  steps: int = 3) -> ShardStep:
    """labkit's ``ShardedOptimizer`` over torch's AdamW (``ADAMW``): each rank steps a flat
    slice, the gradients reduce-scattered at the step."""
    model = _seeded_model(model_name, ctx.device)
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, ctx.group, **ADAMW)
    batches = rank_tokens(ctx, model.cfg.vocab_size, batch, seq, steps)
    step = measure_rank(ctx, model, model, opt, batches, states=opt.inner)
    return ShardStep(**vars(step), param_bytes=_held_bytes(model.parameters()),
                     state_bytes=_state_bytes(opt.inner))


def fsdp_accumulation_step(ctx, model_name: str = "small", seq: int = 64, micro_batches: int = 4,
                           hold: bool = False, steps: int = 2) -> RankStep:
    """labkit's ``FullyShardedDataParallel`` (a unit per block) over ``micro_batches`` rows of
    one sequence per step: each micro-batch's gradients reduce-scattered, or (``hold``) summed
    whole under ``no_sync`` and reduce-scattered once. The last step's peak and bytes sent."""
    model = _seeded_model(model_name, ctx.device)
    sharded = FullyShardedDataParallel(model, ctx.group, units=(Block,))
    opt = torch.optim.AdamW(sharded.parameters(), **ADAMW)
    losses = []
    with MemoryTracker(sharded, opt, timeline=False) as mt:
        for i, tokens in enumerate(rank_tokens(ctx, model.cfg.vocab_size, micro_batches, seq,
                                               steps)):              # (micro_batches, seq + 1)
            if i == steps - 1:
                mt.tag_states()
                mt.reset_peak()
                sharded.sent.clear()
            for j, row in enumerate(tokens.split(1)):                 # (1, seq + 1)
                keep = hold and j < micro_batches - 1
                with sharded.no_sync() if keep else contextlib.nullcontext():
                    with mt.phase("forward"):
                        loss = sharded(row[:, :-1], row[:, 1:]) / micro_batches
                    with mt.phase("backward"):
                        loss.backward()
                losses.append(loss.item())
            with mt.phase("optimizer"):
                opt.step()
            opt.zero_grad(set_to_none=True)
    return RankStep(ctx.rank, losses, mt.peak, dict(mt.peak_by_category), mt.peak_phase,
                    dict(sharded.sent))


def fsdp_accumulation(ctx, model_name: str = "small", seq: int = 64,
                      micro_batches: int = 4) -> dict:
    """``fsdp_accumulation_step`` both ways on this rank: {"each micro-batch": ..., "no_sync": ...}."""
    return {name: fsdp_accumulation_step(ctx, model_name, seq, micro_batches, hold)
            for name, hold in (("each micro-batch", False), ("no_sync", True))}


def side_by_side(ctx, model_name: str = "tiny", batch: int = 1, seq: int = 32, steps: int = 3,
                 stages=(1, 3)) -> dict:
    """Each wrapper in turn on this rank (one cluster start for all): {name: ShardStep}."""
    out = {"ZeroRedundancyOptimizer": zero_redundancy_step(ctx, model_name, batch, seq, steps),
           "ZeroRedundancyOptimizer under DDP": zero_redundancy_step(ctx, model_name, batch, seq,
                                                                     steps, under_ddp=True),
           "FSDP2": fsdp2_step(ctx, model_name, batch, seq, steps),
           "FSDP2, no reshard": fsdp2_step(ctx, model_name, batch, seq, steps,
                                           reshard_after_forward=False)}
    for stage in stages:
        out[f"labkit ZeRO-{stage}"] = labkit_zero_step(ctx, stage, model_name, batch, seq, steps)
    out["labkit ShardedOptimizer"] = labkit_sharded_optimizer_step(ctx, model_name, batch, seq,
                                                                   steps)
    out["labkit FSDP"] = labkit_fsdp_step(ctx, model_name, batch, seq, steps)
    return out


# ---- full scale: FSDP2 on fake tensors under a fake process group -----------------------------
@contextlib.contextmanager
def fake_group(world_size: int, rank: int = 0):
    """A fake process group of ``world_size`` ranks for the block: this process is ``rank``,
    collectives return at once. It is the default group (FSDP2 and DeviceMesh look it up
    there), so it is destroyed on leaving, and refused if the process already has one."""
    from torch.testing._internal.distributed.fake_pg import FakeStore   # registers "fake"

    if dist.is_initialized():
        raise ValueError("this process already has a default process group (inside "
                         "cluster.run, say); call the fake FSDP2 measurement from a process "
                         "without one, such as the notebook's kernel")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def fake_fsdp2_peak(cfg_name, world_size: int, batch: int = 1, seq: int = 4096,
                    precision: str = "bf16-master", reshard_after_forward: bool = True,
                    recompute: str = "none", placement: str = "dim0", rank: int = 0,
                    cross_check: bool = False, trainable: str = "all",
                    lora_rank: int = 16, weight_format: str | None = None,
                    autocast_cache: bool = True, param_dtype: str | None = None,
                    optimizer_impl: str | None = None) -> dict:
    """One rank's bytes in one steady-state FSDP2 training step of ``cfg_name`` over
    ``world_size`` ranks, on fake tensors with CUDA's defaults (AdamW foreach, or
    ``optimizer_impl``: "fused" etc., as ``make_optimizer``'s ``impl``).

    ``bf16-master``: FSDP2 shards bf16 weights; labkit's ``MasterWeights`` keeps the fp32
    master and moments of the shards (2 + 2 + 12 bytes per parameter / N). FSDP2's own
    ``MixedPrecisionPolicy`` instead keeps fp32 shards and casts each to bf16 before the
    all-gather (it gathers bf16 too), its gradient shards fp32: 4 + 4 + 8, the same 16.
    ``bf16-mixed``: fp32 shards under ``torch.autocast`` (``autocast_cache``: its
    ``cache_enabled``); ``param_dtype`` ("bf16") gives FSDP2 that ``MixedPrecisionPolicy``.
    ``cross_check`` runs one more step under torch's ``FSDPMemTracker`` and returns its peak
    too. Returns a dict: ``peak``, ``by_category``,
    ``peak_phase``, ``param_bytes`` (this rank's shards), ``seconds``.
    """
    from labkit.training.measure import _batch, _build, _Setup, init_optimizer_state

    check_choice("precision", precision, FAKE_PRECISIONS)
    check_choice("placement", placement, PLACEMENTS)
    if not isinstance(world_size, int) or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"world_size={world_size!r}, rank={rank!r}: need an int world_size "
                         ">= 1 and 0 <= rank < world_size")
    cfg = preset(cfg_name) if isinstance(cfg_name, str) else cfg_name
    if seq > cfg.max_seq:
        raise ValueError(f"seq={seq} exceeds the model's max_seq={cfg.max_seq}; "
                         f"use cfg.replace(max_seq={seq})")
    start = time.perf_counter()
    with fake_group(world_size, rank) as group:
        mesh = DeviceMesh.from_group(group, "cpu")          # outside FakeTensorMode
        # FSDP2's way for big models: build and shard on the meta device (no memory, no fake
        # tensor for each of the N chunks of every parameter), then make this rank's shards
        model = _build(_Setup(cfg, None, "cuda", torch.device("meta")), precision, recompute,
                       trainable=trainable, lora_rank=lora_rank, weight_format=weight_format)
        tracked_modules = shard_blocks(model, mesh, reshard_after_forward, placement,
                                       param_dtype and torch_dtype(param_dtype))
        with FakeTensorMode(allow_non_fake_inputs=True):    # to_empty reads the meta tensors
            model.to_empty(device="cpu")                    # CPU fake tensors, CUDA's defaults
            tracked = FSDP2Parameters(model, tracked_modules)
            opt = make_optimizer([p for p in model.parameters() if p.requires_grad], "adamw",
                                 optimizer_impl, device="cuda",
                                 master_weights=precision == "bf16-master")
            init_optimizer_state(model, opt)                # a steady-state step
            inputs, targets, step = _batch(model, batch, seq, None, torch.device("cpu"))
            with MemoryTracker(tracked, opt, timeline=False) as mt:
                train_step(step, opt, inputs, targets, precision, tracker=mt,
                           autocast_cache=autocast_cache)
            out = dict(peak=mt.peak, by_category=dict(mt.peak_by_category),
                       peak_phase=mt.peak_phase, param_bytes=_held_bytes(model.parameters()))
            if cross_check:
                out["fsdp_mem_tracker"] = _fsdp_mem_tracker_peak(model, opt, inputs, targets,
                                                                  precision)
    out["seconds"] = time.perf_counter() - start
    return out


def _fsdp_mem_tracker_peak(model, opt, inputs, targets, precision) -> dict:
    """torch's ``FSDPMemTracker`` over one more step: its peak total and categories (bytes)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    fmt = FSDPMemTracker(model, getattr(opt, "inner", opt))   # MasterWeights: its AdamW
    fmt.track_inputs((inputs, targets))
    with fmt:
        train_step(model, opt, inputs, targets, precision)
    (snapshot,) = fmt.get_tracker_snapshot("peak").values()  # one device
    return {str(getattr(k, "value", k)): v for k, v in snapshot.items() if v}


def fake_fsdp2_scaling(cfg_name, worlds=WORLDS, batch: int = 1, seq: int = 4096,
                       precision: str = "bf16-master", reshard_after_forward: bool = True,
                       recompute: str = "none", placement: str = "dim0") -> list[dict]:
    """``fake_fsdp2_peak`` for each N in ``worlds`` beside ``labkit.estimate(zero_stage=3,
    dp=N)``: one row per N. A case the fake group cannot run keeps its ``error``."""
    from labkit.predict.layers import count_params
    from labkit.predict import estimate

    n_params = count_params(preset(cfg_name) if isinstance(cfg_name, str) else cfg_name).total
    rows = []
    for n in worlds:
        est = estimate(cfg_name, batch, seq, precision=precision, recompute=recompute,
                       zero_stage=3, dp=n, device="cuda")
        row = dict(world_size=n, n_params=n_params, precision=precision, estimate=est.total,
                   estimate_by_category={k: getattr(est, k) for k in CATEGORIES},
                   estimate_phase=est.peak_phase)
        try:
            row.update(fake_fsdp2_peak(cfg_name, n, batch, seq, precision,
                                       reshard_after_forward, recompute, placement))
            row["ratio"] = row["peak"] / est.total
        except Exception as error:          # noqa: BLE001 - the row says why
            row["error"] = f"{type(error).__name__}: {error}"
        rows.append(row)
    return rows

