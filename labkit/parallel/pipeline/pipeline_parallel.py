"""Pipeline parallelism: which layers each stage holds, how many micro-batches of activations
it keeps (Narayanan et al., 2021), and a real executor that runs a schedule on p processes.

``stage_layers`` and ``in_flight`` (in ``schedules``, torch-free) are what ``labkit.estimate``
uses. ``run_schedules`` runs
the op lists of ``labkit.parallel.pipeline.schedules`` (GPipe, 1F1B, interleaved 1F1B, ZB-H1) on the
ranks of a ``labkit.parallel.cluster`` for the labkit model cut by ``stage_layers``: stage 0
holds the embedding, the last stage the final norm, the LM head and the loss. Each rank
notes when each op ran and what the ``MemoryTracker`` saw; ``measure_schedules`` puts the
ranks together, and ``predicted_held`` says what each stage should hold;
``labkit.parallel.pipeline.torch_runtime`` runs torch.distributed.pipelining's schedules on the
same chunks beside it.

Messages are ``batch_isend_irecv`` ops tagged by (kind, micro-batch, virtual stage): with
interleaving, activations and gradients cross the same pair of ranks in orders that differ
between sender and receiver. A rank never waits for its own sends (that could deadlock): a
send is let go once a message from the peer shows that the peer's list has passed the op that
takes it. A stage keeps each chunk output it sent until that chunk's backward, as
torch.distributed.pipelining does (Megatron-LM frees its data once sent and keeps only the
autograd node): one (B, T, hidden) tensor per micro-batch in flight more than ``layer_saved``.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.graph import get_gradient_edge

from labkit.core.config import ModelConfig, preset
from labkit.parallel.pipeline.schedules import (SCHEDULES, Op, OpSpan,  # noqa: F401
                                                PipelineTimeline, Schedule, chunk_layers, in_flight,
                                                make_schedule, stage_layers, virtual_stage)
from labkit.transformer.attention import soft_cap
from labkit.transformer.model import embed_tokens

# ---- one chunk of the model --------------------------------------------------------------------
def mean_loss(logits, targets):
    """The loss every stage computes: (B, T, vocab) logits, (B, T) targets -> mean in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class PipelineChunk(nn.Module):
    """Consecutive blocks of a ``Transformer`` (sharing its modules), with the embedding in
    front on the first virtual stage and the final norm + LM head behind on the last."""

    def __init__(self, model, layers: range, first: bool, last: bool):
        super().__init__()
        self.embed = model.embed if first else None
        self.cfg = model.cfg
        self.blocks = nn.ModuleList(model.blocks[i] for i in layers)
        self.rope = model.rope
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x, targets=None):
        """Tokens (B, T) on the first chunk, else the residual stream (B, T, hidden) ->
        the residual stream, or on the last chunk the logits (B, T, vocab) or the mean loss."""
        if self.embed is not None:
            x = embed_tokens(self.embed, x, self.cfg)                        # (B, T, hidden)
        for block in self.blocks:
            x = block(x, self.rope)
        if self.lm_head is None:
            return x
        logits = soft_cap(self.lm_head(self.norm(x)), self.cfg.logit_softcap)  # (B, T, vocab)
        return logits if targets is None else mean_loss(logits, targets)


def build_chunks(cfg: ModelConfig, stage: int, p: int, v: int = 1, seed: int = 0,
                 lora_rank: int = 0, placement: str = "loop"):
    """Stage ``stage``'s v chunks of the model that one process would build from ``seed``,
    and {parameter: its name in that model} (to compare gradients with one process).
    ``lora_rank`` > 0: the model frozen under rank-r LoRA adapters
    (``labkit.quantisation.lora``). ``placement``: "loop" or "v" (``chunk_layers``)."""
    from labkit.quantisation.lora import apply_lora
    from labkit.transformer.model import build_model
    if cfg.tie_embeddings and p > 1:
        raise ValueError("tied embeddings put one weight on the first and the last stage; "
                         "use a config with tie_embeddings=False for pipeline parallelism")
    torch.manual_seed(seed)
    model = build_model(cfg)
    if lora_rank:
        apply_lora(model, lora_rank)
    names = {param: name for name, param in model.named_parameters()}
    chunks = [PipelineChunk(model, layers, first=virtual_stage(stage, c, p, placement) == 0,
                            last=virtual_stage(stage, c, p, placement) == p * v - 1)
              for c, layers in enumerate(chunk_layers(cfg.layers, p, v, placement)[stage])]
    return chunks, {q: names[q] for chunk in chunks for q in chunk.parameters()}


def micro_batches(cfg: ModelConfig, m: int, micro_batch: int, seq: int, seed: int = 0):
    """The same m micro-batches on every rank: (inputs, targets) pairs of (micro_batch, seq)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (m * micro_batch, seq + 1), generator=g)
    return [(rows[:, :-1].clone(), rows[:, 1:].clone()) for rows in tokens.split(micro_batch)]


# ---- the executor ----------------------------------------------------------------------------
@dataclass
class StageRun:
    """One rank's run of a schedule: when each op ran and what the tracker saw."""

    stage: int
    spans: list                     # OpSpan, in seconds on the machine's monotonic clock
    losses: list                    # the last stage's loss of each micro-batch, else []
    grads: dict                     # parameter name -> gradient of the micro-batches' mean loss
    peak: int = 0                   # the tracker's peak, every category (bytes)
    peak_by_category: dict = field(default_factory=dict)
    held: int = 0                   # the most activation bytes kept at once (above the start)


def _note_module_outputs(chunk: PipelineChunk, noted: list) -> list:
    """Forward hooks noting (module, gradient edge of its output) for each module that owns
    parameters that train: where a split backward's W starts. An edge, not the tensor: noting
    it keeps no memory alive that autograd would have freed."""
    def note(module, args, out):
        noted.append((module, get_gradient_edge(out)))
    return [m.register_forward_hook(note) for m in chunk.modules()
            if any(q.requires_grad for q in m.parameters(recurse=False))]


class _Executor:
    """Runs one stage's op list: receives, computes, sends, and keeps what backward needs."""

    def __init__(self, ctx, schedule: Schedule, chunks: list, batches: list, hidden: int,
                 tracker=None):                          # a labkit.training.track.MemoryTracker
        self.ctx, self.schedule, self.chunks, self.batches = ctx, schedule, chunks, batches
        self.hidden, self.tracker = hidden, tracker
        self.m, self.last = schedule.m, schedule.p * schedule.v - 1
        self.saved = {}             # (mb, chunk) -> (input, output, noted module outputs)
        self.for_w = {}             # (mb, chunk) -> [(module, output edge, its gradient)]
        self.sends = []             # (works, tensor, peer, the peer's op that receives it)
        # where each op sits in each stage's list: a message from a peer tells how far it got
        self.position = [{op: i for i, op in enumerate(ops)} for ops in schedule.stages]
        self.losses = [0.0] * self.m
        self.start_bytes = tracker.by_category["activations"] if tracker else 0
        self.held = 0
        self.started = 0.0          # when the current op had its inputs (after any receive)

    # ---- messages --------------------------------------------------------------------
    def _tag(self, kind: str, mb: int, k: int) -> int:
        """One tag per message: an activation ("F") or a gradient ("B") for virtual stage k."""
        return ("FB".index(kind) * self.m + mb) * (self.last + 1) + k

    def _op_at(self, kind: str, mb: int, k: int) -> tuple[int, int]:
        """(rank, index in its list) of virtual stage k's op ``kind`` for micro-batch mb."""
        rank, chunk = k % self.schedule.p, k // self.schedule.p
        return rank, self.position[rank][Op(kind, mb, chunk)]

    def _recv(self, kind: str, mb: int, k: int, shape, dtype) -> torch.Tensor:
        """Wait for virtual stage k's input (F: from k - 1) or output gradient (B: from k + 1)."""
        buf = torch.empty(shape, dtype=dtype)
        peer, sent_at = self._op_at(kind, mb, k - 1 if kind == "F" else k + 1)
        op = dist.P2POp(dist.irecv, buf, peer, self.ctx.group, self._tag(kind, mb, k))
        for work in dist.batch_isend_irecv([op]):
            work.wait()
        self.started = time.perf_counter()
        # the peer has run its list up to sent_at: every message of ours that an earlier op
        # of its took has arrived, and its buffer can go (a send does not end by itself)
        arrived = [s for s in self.sends if s[2] == peer and s[3] <= sent_at]
        for works, *_ in arrived:
            for work in works:
                work.wait()                           # returns at once
        self.sends = [s for s in self.sends if s not in arrived]
        return buf

    def _send(self, kind: str, mb: int, k: int, tensor: torch.Tensor):
        """Post virtual stage k's output (F, to k + 1) or input gradient (B, to k - 1) and go
        on: the receiver takes it when its own list reaches the op that needs it."""
        to = k + 1 if kind == "F" else k - 1
        peer, taken_at = self._op_at(kind, mb, to)
        op = dist.P2POp(dist.isend, tensor, peer, self.ctx.group, self._tag(kind, mb, to))
        self.sends.append((dist.batch_isend_irecv([op]), tensor, peer, taken_at))

    # ---- the three kinds of op -------------------------------------------------------
    def forward(self, op: Op):
        k = self.schedule.virtual_stage(self.ctx.rank, op.chunk)
        chunk, (inputs, targets) = self.chunks[op.chunk], self.batches[op.micro_batch]
        if k == 0:
            x = inputs                                                       # (B, T) tokens
        else:
            x = self._recv("F", op.micro_batch, k, (*inputs.shape, self.hidden),
                           torch.get_default_dtype()).requires_grad_()      # (B, T, hidden)
        noted = []
        hooks = _note_module_outputs(chunk, noted) if self.schedule.split_backward else []
        out = chunk(x, targets if k == self.last else None)     # (B, T, hidden), or the loss
        for hook in hooks:
            hook.remove()
        if k == self.last:
            self.losses[op.micro_batch] = out.item()
        else:
            self._send("F", op.micro_batch, k, out.detach())   # the data, not the graph
        self.saved[op.micro_batch, op.chunk] = (x, out, noted)
        if self.tracker is not None:
            self.held = max(self.held, self.tracker.by_category["activations"] - self.start_bytes)

    def backward(self, op: Op):
        """B: the input's gradient, sent to the virtual stage before; without W ops in the
        schedule, the weights' gradients too (a full backward)."""
        k = self.schedule.virtual_stage(self.ctx.rank, op.chunk)
        x, out, noted = self.saved.pop((op.micro_batch, op.chunk))
        if k == self.last:
            grad = torch.tensor(1.0 / self.m)        # the step's loss: the micro-batches' mean
        else:
            grad = self._recv("B", op.micro_batch, k, out.shape, out.dtype)
        if not self.schedule.split_backward:
            torch.autograd.backward(out, grad)       # into every weight's .grad and x.grad
            if k > 0:
                self._send("B", op.micro_batch, k, x.grad)
            return
        # split: the gradients of x and of each noted module output, none of the weights';
        # the graph stays (retain_graph) for W
        edges = [edge for _, edge in noted]
        grads = torch.autograd.grad(out, ([x] if k > 0 else []) + edges, grad,
                                    retain_graph=True, allow_unused=True)
        if k > 0:
            self._send("B", op.micro_batch, k, grads[0])
        self.for_w[op.micro_batch, op.chunk] = [
            (module, edge, g) for (module, edge), g in zip(noted, grads[len(grads) - len(edges):])
            if g is not None]

    def weight(self, op: Op):
        """W: each module's weight gradients, from the gradient of its output that B kept."""
        from labkit.training.track import tag_live
        for module, edge, g in self.for_w.pop((op.micro_batch, op.chunk)):
            params = [q for q in module.parameters(recurse=False) if q.requires_grad]
            # allow_unused: a router bias only picks experts, and gets no gradient
            for param, pg in zip(params, torch.autograd.grad(edge, params, g, retain_graph=True,
                                                             allow_unused=True)):
                if pg is None:
                    continue
                if param.grad is None:
                    param.grad = pg
                    tag_live(pg, "grads")
                else:
                    param.grad += pg                 # as autograd accumulates, in place

    def run(self) -> list:
        """This stage's ops in order; each op's span starts once its inputs have arrived."""
        do = {"F": self.forward, "B": self.backward, "W": self.weight}
        spans = []
        for op in self.schedule.stages[self.ctx.rank]:
            phase = "forward" if op.kind == "F" else "backward"
            with self.tracker.phase(phase) if self.tracker else contextlib.nullcontext():
                self.started = time.perf_counter()
                do[op.kind](op)
                spans.append(OpSpan(op, self.started, time.perf_counter()))
        for works, *_ in self.sends:
            for work in works:
                work.wait()
        self.sends.clear()
        return spans


def run_schedules(ctx, cfg, cases: list, micro_batch: int = 1, seq: int = 16, track: bool = True,
                  seed: int = 0, lora_rank: int = 0) -> list[StageRun]:
    """On each rank of a cluster of p: run every (schedule, m, v) of ``cases`` for the model
    ``cfg`` (a ModelConfig or a preset name), one after the other; this rank's ``StageRun``
    of each. ``track``: measure memory (the tracker slows every op: time without it).
    ``lora_rank`` > 0: LoRA's adapters train, the model is frozen."""
    from labkit.training.track import MemoryTracker
    torch.set_num_threads(1)            # tiny matmuls; the cores are shared by the ranks
    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    out = []
    for name, m, v in cases:
        schedule = make_schedule(name, ctx.world_size, m, v)
        if v > 1 and ctx.world_size == 1:
            raise ValueError("interleaving sends between chunks of different ranks: run v > 1 "
                             "on 2 or more ranks")
        chunks, names = build_chunks(cfg, ctx.rank, schedule.p, v, seed, lora_rank)
        batches = micro_batches(cfg, m, micro_batch, seq, seed)
        stage = nn.ModuleList(chunks)
        dist.barrier(group=ctx.group)                     # every stage starts together
        if track:
            with MemoryTracker(stage, timeline=False) as mt:
                for tensor in (t for pair in batches for t in pair):
                    mt.tag(tensor, "other")               # the data, loaded before the step
                executor = _Executor(ctx, schedule, chunks, batches, cfg.hidden, mt)
                spans = executor.run()
            memory = dict(peak=mt.peak, peak_by_category=dict(mt.peak_by_category),
                          held=executor.held)
        else:
            executor = _Executor(ctx, schedule, chunks, batches, cfg.hidden)
            spans, memory = executor.run(), {}
        grads = {names[q]: q.grad for q in stage.parameters() if q.grad is not None}
        losses = executor.losses if ctx.rank == ctx.world_size - 1 else []
        out.append(StageRun(ctx.rank, spans, losses, grads, **memory))
        dist.barrier(group=ctx.group)
    return out


# ---- in the parent: the ranks put together ---------------------------------------------------
@dataclass
class ScheduleRun:
    """A schedule run on p ranks: the measured timeline, and what each stage saw."""

    schedule: Schedule
    timeline: PipelineTimeline      # seconds from the first op's start
    stages: list                    # StageRun per stage

    @property
    def losses(self) -> list:
        return self.stages[-1].losses

    @property
    def grads(self) -> dict:
        return {name: g for stage in self.stages for name, g in stage.grads.items()}


def measure_schedules(cfg, p: int, cases: list, micro_batch: int = 1, seq: int = 16,
                      track: bool = True, seed: int = 0, timeout_s: float = 300,
                      lora_rank: int = 0) -> list:
    """Run each (schedule, m, v) of ``cases`` on p new processes (``run_schedules``); one
    ``ScheduleRun`` per case, its timeline on a clock shared by the ranks."""
    from labkit.parallel.cluster import run
    ranks = run(run_schedules, p, cfg, cases, micro_batch, seq, track, seed, lora_rank,
                timeout_s=timeout_s)
    return assemble_ranks(ranks, cases, p)


def assemble_ranks(ranks: list, cases: list, p: int) -> list[ScheduleRun]:
    """Each rank's list of StageRuns -> one ScheduleRun per case, timed from its first op."""
    out = []
    for i, (name, m, v) in enumerate(cases):
        stages = [runs[i] for runs in ranks]
        t0 = min(span.start for stage in stages for span in stage.spans)
        schedule = make_schedule(name, p, m, v)
        timeline = PipelineTimeline(
            name, p, m, v, [[OpSpan(op, a - t0, b - t0) for op, a, b in stage.spans]
                            for stage in stages], schedule.peak_held())
        out.append(ScheduleRun(schedule, timeline, stages))
    return out


def one_process_step(cfg, m: int, micro_batch: int = 1, seq: int = 16, seed: int = 0):
    """The same micro-batches through the whole model in one process: the losses, and the
    gradients of their mean by parameter name (what every schedule must reproduce)."""
    from labkit.transformer.model import build_model
    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    torch.manual_seed(seed)
    model = build_model(cfg)
    losses = []
    for inputs, targets in micro_batches(cfg, m, micro_batch, seq, seed):
        loss = model(inputs, targets)
        loss.backward(torch.tensor(1.0 / m))
        losses.append(loss.item())
    return losses, {name: q.grad for name, q in model.named_parameters()}


# ---- what the stages should hold -------------------------------------------------------------
def micro_batch_terms(cfg, layers: range, micro_batch: int, seq: int, last: bool,
                      precision: str = "fp32") -> list[tuple[str, int, str]]:
    """Activation bytes one micro-batch leaves on a chunk, as (term, bytes, until): what its
    layers save (``layers.layer_saved``), on the last chunk the head's (``head_saved``) and
    the loss, elsewhere the chunk's output, which the sender keeps for its backward (the
    receiver holds its own copy as the next layer's saved input). ``until`` "W": freed by the
    op that computes the weight gradients (W, or B when it does both); "B": freed by B."""
    from labkit.predict.layers import head_saved, layer_saved
    from labkit.core.recipe import state_bytes
    B, T = micro_batch, seq
    terms = [("layers' saved tensors", sum(layer_saved(cfg, precision, moe=i >= cfg.dense_layers,
                                                       layer=i).bytes(B, T) for i in layers), "W")]
    if not last:
        stream = state_bytes(precision).weights                  # the residual stream's dtype
        return terms + [("output kept for the backward", B * T * cfg.hidden * stream, "B")]
    for term in head_saved(cfg, precision):
        # the log-softmax sits above every weight: a split B is done with it
        until = "B" if term.name.startswith("log-softmax") else "W"
        terms.append((term.name, term.bytes(B, T), until))
    return terms + [("loss and the loss's total weight (fp32 scalars)", 8, "B")]


def predicted_held(schedule: Schedule, cfg, micro_batch: int, seq: int) -> list[int]:
    """Per stage, the most activation bytes it keeps at once under ``schedule``: the terms of
    the (micro-batch, chunk) pairs held after each F (``micro_batch_terms``), each let go by
    the B or W that frees it."""
    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    p, v = schedule.p, schedule.v
    freed_by_w = "W" if schedule.split_backward else "B"
    out = []
    for s, ops in enumerate(schedule.stages):
        chunks = [micro_batch_terms(cfg, layers, micro_batch, seq,
                                    last=schedule.virtual_stage(s, c) == p * v - 1)
                  for c, layers in enumerate(chunk_layers(cfg.layers, p, v,
                                                          schedule.placement)[s])]
        frees = [{kind: sum(b for _, b, until in terms
                            if (freed_by_w if until == "W" else "B") == kind) for kind in "BW"}
                 for terms in chunks]
        live = peak = 0
        for op in ops:
            if op.kind == "F":
                live += sum(frees[op.chunk].values())
                peak = max(peak, live)
            else:
                live -= frees[op.chunk][op.kind]
        out.append(peak)
    return out
