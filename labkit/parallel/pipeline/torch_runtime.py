"""torch.distributed.pipelining's own runtime on the chunks, weights and micro-batches of
labkit's executor (``pipeline_parallel.run_schedules``): its losses, gradients and each stage's
peak, beside ours (``compare_with_torch``). ZB-V and DualPipeV run here only:
their chunks sit in a V (stage s holds virtual stages s and 2p - 1 - s, so rank 0 computes the
loss), an order labkit's executor does not route.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import schedules as torch_schedules

from labkit.core.config import preset
from labkit.parallel.cluster import run
from labkit.parallel.pipeline.pipeline_parallel import (StageRun, assemble_ranks,
                                                        build_chunks, mean_loss, micro_batches,
                                                        run_schedules)
from labkit.core.recipe import placement_of
from labkit.parallel.pipeline.schedules import virtual_stage
from labkit.training.track import MemoryTracker

TORCH_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                 "interleaved": "ScheduleInterleaved1F1B", "zb-v": "ScheduleZBVZeroBubble",
                 "dualpipe-v": "ScheduleDualPipeV"}


def torch_pipelining(ctx, cfg, cases: list, micro_batch: int = 1, seq: int = 16,
                     seed: int = 0) -> list[StageRun]:
    """torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble ("zb-v") or ScheduleDualPipeV ("dualpipe-v", v = 2 in a V) on the
    chunks, weights and micro-batches of ``run_schedules``: this rank's losses, gradients and
    tracker peak for each (schedule, m, v) of ``cases`` (no op timeline)."""
    torch.set_num_threads(1)
    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    p, out = ctx.world_size, []
    for name, m, v in cases:
        chunks, names, stages, ends = _torch_stages(ctx, cfg, name, v, seed)
        batches = micro_batches(cfg, m, micro_batch, seq, seed)
        inputs = torch.cat([i for i, _ in batches])                   # (m * B, T)
        targets = torch.cat([t for _, t in batches])                  # (m * B, T)
        stage = nn.ModuleList(chunks)
        dist.barrier(group=ctx.group)
        with MemoryTracker(stage, timeline=False) as mt:
            mt.tag(inputs, "other")
            mt.tag(targets, "other")
            forward = _ForwardPhase(mt)          # chunks' forwards and the loss: activations
            hooks = [h for chunk in chunks for h in (chunk.register_forward_pre_hook(forward.enter),
                                                     chunk.register_forward_hook(forward.leave))]

            def loss_fn(logits, target):
                forward.enter()
                loss = mean_loss(logits, target)
                forward.leave()
                return loss
            schedule = getattr(torch_schedules, TORCH_CLASSES[name])(
                stages if len(stages) > 1 else stages[0], m, loss_fn=loss_fn)
            losses = []
            with mt.phase("backward"):
                schedule.step(*([inputs] if ends[0] else []), return_outputs=False,
                              target=targets if ends[1] else None, losses=losses)
            for hook in hooks:
                hook.remove()
        held = forward.held
        grads = {names[q]: q.grad for q in stage.parameters() if q.grad is not None}
        out.append(StageRun(ctx.rank, [], [x.item() for x in losses], grads, mt.peak,
                            dict(mt.peak_by_category), held))
        dist.barrier(group=ctx.group)
    return out


def _torch_stages(ctx, cfg, name: str, v: int, seed: int) -> tuple:
    """(chunks, {parameter: name}, torch's PipelineStage per chunk, (holds the first virtual
    stage, holds the last)) of this rank for schedule ``name``: a loop, or a V for ZB-V and
    DualPipeV (rank 0 then holds the first chunk and the loss)."""
    from torch.distributed.pipelining import PipelineStage
    if name not in TORCH_CLASSES:
        raise ValueError(f"torch.distributed.pipelining is compared on {', '.join(TORCH_CLASSES)}"
                         f"; {name!r} has no counterpart here")
    p, placement = ctx.world_size, placement_of(name)
    chunks, names = build_chunks(cfg, ctx.rank, p, v, seed, placement=placement)
    virtual = [virtual_stage(ctx.rank, c, p, placement) for c in range(v)]
    stages = [PipelineStage(chunk, i, p * v, ctx.device, group=ctx.group)
              for chunk, i in zip(chunks, virtual)]
    return chunks, names, stages, (0 in virtual, p * v - 1 in virtual)


class _ForwardPhase:
    """Puts what runs between ``enter`` and ``leave`` in the tracker's "forward" phase (as our
    executor's F ops) and notes the activations held after each forward, as ours does."""

    def __init__(self, tracker):
        self.tracker, self.phases = tracker, []
        self.start = tracker.by_category["activations"]
        self.held = 0

    def enter(self, *hook_args):
        self.phases.append(self.tracker.phase("forward"))
        self.phases[-1].__enter__()

    def leave(self, *hook_args):
        self.phases.pop().__exit__(None, None, None)
        self.held = max(self.held, self.tracker.by_category["activations"] - self.start)


def ours_and_torch(ctx, cfg, cases, micro_batch, seq, seed):
    """labkit's executor, then torch's runtime, on this rank (``compare_with_torch``)."""
    return (run_schedules(ctx, cfg, cases, micro_batch, seq, True, seed),
            torch_pipelining(ctx, cfg, cases, micro_batch, seq, seed))


def compare_with_torch(cfg, p: int, cases: list, micro_batch: int = 1, seq: int = 16,
                       seed: int = 0, timeout_s: float = 300) -> list[tuple]:
    """Each (schedule, m, v) of ``cases`` run by labkit's executor and by torch.distributed.
    pipelining on the same p processes: (our ScheduleRun, torch's StageRun per stage)."""
    ranks = run(ours_and_torch, p, cfg, cases, micro_batch, seq, seed, timeout_s=timeout_s)
    ours = assemble_ranks([r[0] for r in ranks], cases, p)
    return [(run_, [r[1][i] for r in ranks]) for i, run_ in enumerate(ours)]
