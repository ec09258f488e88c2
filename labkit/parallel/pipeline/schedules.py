"""Pipeline schedules as explicit lists of operations per stage, checked and simulated.

An operation is (kind, micro-batch, chunk): ``F`` the forward pass, ``B`` the backward pass
and ``W`` the weight gradient. Zero-bubble schedules split the backward in two (Qi et al.,
2023): B computes only the gradient of the chunk's input (what the stage before waits for),
W the weights' gradients later, where the pipeline would idle. A schedule without W ops runs
both in its B. Stage s of p holds v chunks of the model: chunks s, s + p, s + 2p, ... (chunk
c of stage s is virtual stage c * p + s); v > 1 only for the interleaved schedule. The V-shaped
schedules torch ships (ZB-V, DualPipeV: ``labkit.parallel.pipeline.torch_orders``) place two
chunks per stage in a V: stage s holds virtual stages s and 2p - 1 - s.

| schedule        | paper                                    | each stage s runs               |
| --------------- | ---------------------------------------- | ------------------------------- |
| ``gpipe``       | GPipe (Huang et al., 2019)               | every F, then every B           |
| ``1f1b``        | PipeDream-Flush (Narayanan et al., 2021) | p - s - 1 F, then F B pairs     |
| ``interleaved`` | Megatron-LM (Narayanan et al., 2021)     | 1F1B over v chunks, rounds of p |
| ``zb-h1``       | Zero Bubble, ZB-H1 (Qi et al., 2023)     | 1F1B, B / W split, s W's last   |

``simulate(schedule, durations)`` places every op as early as its stage and its inputs allow:
the timeline per stage, its idle (bubble) fraction and the micro-batches each stage holds.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, NamedTuple

from labkit.core.recipe import SCHEDULES  # noqa: F401 - the vocabulary, named here for the executor
from labkit.core.units import check_choice, check_positive


def pending_w(stage: int, pp: int, micro_batches: int, schedule: str) -> Fraction:
    """Micro-batches (of the stage's layers) whose B has run and W not yet, at most, at a W:
    ZB-H1 defers s W's (s + 1 at the W); in a V (``torch_orders``) ZB-V 1/2 up to m = p and
    s + 1/2 from m = 2p - 1 (between, torch's order defers fewer: a bound), DualPipeV
    (s + 1) / 2. 0 for schedules with a whole backward."""
    if schedule == "zb-h1":
        return Fraction(min(stage + 1, micro_batches))
    if schedule == "zb-v":
        return Fraction(2 * stage + 1, 2) if micro_batches > pp else Fraction(1, 2)
    if schedule == "dualpipe-v":
        return Fraction(stage + 1, 2)
    return Fraction(0)


def stage_layers(layers: int, pp: int) -> list[range]:
    """Layer indices of each of ``pp`` stages: contiguous, non-empty, sizes differing by at
    most one (the first stages take the extra layers). 32 layers over pp=6: 6,6,5,5,5,5."""
    if not 1 <= pp <= layers:
        raise ValueError(f"pp={pp} must be between 1 and layers={layers}; a pipeline stage needs "
                         f"at least one layer")
    base, extra = divmod(layers, pp)
    bounds = [0]
    for s in range(pp):
        bounds.append(bounds[-1] + base + (s < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def in_flight(stage: int, pp: int, micro_batches: int, schedule: str = "1f1b",
              v: int = 1) -> Fraction:
    """Micro-batches whose activations stage ``stage`` holds at once: GPipe runs every
    forward first (all ``micro_batches``); 1F1B starts backward after ``pp - stage``; ZB-H1
    defers the weight gradients, which keep their inputs: ``pp`` on every stage. Interleaved
    1F1B holds min(m v, 2 (p - s - 1) + (v - 1) p + 1) chunks of 1/v of the stage's layers.
    In a V (two equal chunks a stage, ``torch_orders``): ZB-V min(p, m, (m + 1 + s) / 2), p on
    every stage from m = 2p; DualPipeV p + 1/2 (m >= 2p)."""
    m = micro_batches
    if schedule == "gpipe":
        return Fraction(m)
    if schedule == "zb-v":
        return min(Fraction(pp), Fraction(m), Fraction(m + 1 + stage, 2))
    if schedule == "dualpipe-v":
        return Fraction(2 * pp + 1, 2)
    if schedule == "zb-h1":
        return Fraction(min(m, pp))
    if schedule == "interleaved":
        return Fraction(min(m * v, 2 * (pp - stage - 1) + (v - 1) * pp + 1), v)
    return Fraction(min(m, pp - stage))


def chunk_layers(layers: int, p: int, v: int = 1, placement: str = "loop") -> list[list[range]]:
    """Per stage, the layers of each of its ``v`` chunks: the model cut into p * v chunks by
    ``stage_layers``, stage s holding chunks s, s + p, s + 2p, ... (virtual stages), or with
    ``placement="v"`` (two chunks) s and 2p - 1 - s."""
    if v > 1 and p * v > layers:
        raise ValueError(f"{p} stages x {v} chunks need at least {p * v} layers (got {layers}): "
                         f"use fewer chunks per stage or a deeper model")
    if placement == "v" and v != 2:
        raise ValueError(f"a V holds two chunks per stage, got v={v}")
    chunks = stage_layers(layers, p * v)
    if placement == "v":
        return [[chunks[s], chunks[2 * p - 1 - s]] for s in range(p)]
    return [[chunks[c * p + s] for c in range(v)] for s in range(p)]


KINDS = ("F", "B", "W")


class Op(NamedTuple):
    """One operation of a stage: ``kind`` F, B or W of ``micro_batch`` on its local ``chunk``."""

    kind: str
    micro_batch: int
    chunk: int = 0

    def __str__(self):
        return f"{self.kind}{self.micro_batch}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Schedule:
    """Every stage's operations, in the order that stage runs them."""

    name: str
    p: int                       # stages (devices)
    m: int                       # micro-batches
    v: int                       # chunks per stage
    stages: tuple                # stages[s]: tuple of Op
    placement: str = "loop"      # "v": two chunks, stage s holds virtual stages s and 2p - 1 - s
    # per stage, (start, stop) index ranges of ops run as one action: their outputs leave together
    # at the last one's end (torch's full backward, DualPipeV's overlapped pairs)
    groups: tuple = ()

    @property
    def split_backward(self) -> bool:
        """True when W ops compute the weight gradients apart from B (zero-bubble schedules)."""
        return any(op.kind == "W" for ops in self.stages for op in ops)

    def virtual_stage(self, stage: int, chunk: int) -> int:
        return virtual_stage(stage, chunk, self.p, self.placement)

    def held(self) -> list[list[int]]:
        """Per stage, the (micro-batch, chunk) pairs whose activations it keeps after each op:
        from F until the backward that frees them (W when the backward is split, else B)."""
        release = "W" if self.split_backward else "B"
        out = []
        for ops in self.stages:
            count, counts = 0, []
            for op in ops:
                count += (op.kind == "F") - (op.kind == release)
                counts.append(count)
            out.append(counts)
        return out

    def peak_held(self) -> list[int]:
        """The most (micro-batch, chunk) pairs each stage keeps at once; / v for micro-batches
        when the chunks are equal."""
        return [max(counts) for counts in self.held()]


# ---- the schedules --------------------------------------------------------------------------
def gpipe(p: int, m: int) -> Schedule:
    """Every forward, then every backward (in micro-batch order, as torch's ScheduleGPipe)."""
    ops = tuple(Op("F", j) for j in range(m)) + tuple(Op("B", j) for j in range(m))
    return Schedule("gpipe", p, m, 1, (ops,) * p)


def _one_f_one_b(p: int, m: int, s: int) -> list[Op]:
    """Stage s: p - s - 1 forwards to fill the pipe, F B pairs, then the backwards left."""
    warmup = min(p - s - 1, m)
    ops = [Op("F", j) for j in range(warmup)]
    for i in range(m - warmup):
        ops += [Op("F", warmup + i), Op("B", i)]
    return ops + [Op("B", j) for j in range(m - warmup, m)]


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-Flush: stage s keeps at most p - s micro-batches (GPipe keeps all m)."""
    return Schedule("1f1b", p, m, 1, tuple(tuple(_one_f_one_b(p, m, s)) for s in range(p)))


def interleaved(p: int, m: int, v: int) -> Schedule:
    """Megatron-LM's interleaved 1F1B: micro-batches go through in rounds of p; each round
    runs chunk 0, then chunk 1, ... on every stage (backwards in the reverse chunk order).
    Warm-up of stage s: 2(p - s - 1) + (v - 1)p forwards; then one forward, one backward."""
    if m % p:
        raise ValueError(f"interleaved 1F1B runs micro-batches in rounds of p={p}: choose m a "
                         f"multiple of {p} (got m={m})")
    total = m * v

    def op(kind, k):            # the k-th forward (or backward) of this stage
        chunk = k % (p * v) // p
        return Op(kind, k // (p * v) * p + k % p, chunk if kind == "F" else v - 1 - chunk)

    stages = []
    for s in range(p):
        warmup = min(total, 2 * (p - s - 1) + (v - 1) * p)
        ops = [op("F", k) for k in range(warmup)]
        for i in range(total - warmup):
            ops += [op("F", warmup + i), op("B", i)]
        stages.append(tuple(ops + [op("B", k) for k in range(total - warmup, total)]))
    return Schedule("interleaved", p, m, v, tuple(stages))


def zb_h1(p: int, m: int) -> Schedule:
    """Zero Bubble's ZB-H1: 1F1B's order of F and B, each B followed by a W, except that stage
    s defers its first s W's to the end. Its last backwards then reach the stage before sooner,
    filling 1F1B's cool-down bubble; every stage holds at most p micro-batches (1F1B's peak)."""
    stages = []
    for s in range(p):
        ops, pending = [], []
        for op in _one_f_one_b(p, m, s):
            ops.append(op)
            if op.kind == "B":
                pending.append(op.micro_batch)
                if len(pending) > s:
                    ops.append(Op("W", pending.pop(0)))
        stages.append(tuple(ops + [Op("W", j) for j in pending]))
    return Schedule("zb-h1", p, m, 1, tuple(stages))


BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb-h1": zb_h1}


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule ``name`` (one of ``BUILDERS``) for p stages and m micro-batches, checked."""
    check_choice("schedule", name, BUILDERS)
    check_positive("p", p)
    check_positive("m", m)
    check_positive("v", v)
    if name == "interleaved":
        schedule = interleaved(p, m, v)
    elif v > 1:
        raise ValueError(f"v={v} chunks per stage needs schedule='interleaved'; use v=1 "
                         f"with {name!r}")
    else:
        schedule = BUILDERS[name](p, m)
    validate(schedule)
    return schedule


# ---- checking and simulating -----------------------------------------------------------------
def validate(schedule: Schedule) -> None:
    """ValueError unless each stage runs every op once, F before B before W of the same
    micro-batch and chunk, and the stages can run their lists without waiting on each other
    forever."""
    kinds = KINDS if schedule.split_backward else ("F", "B")
    want = sorted(Op(k, j, c) for k in kinds for j in range(schedule.m) for c in range(schedule.v))
    for s, ops in enumerate(schedule.stages):
        if sorted(ops) != want:
            missing = set(want) - set(ops)
            extra = [op for op in ops if op not in want or ops.count(op) > 1]
            raise ValueError(f"stage {s} of {schedule.name!r} must run each of F, B"
                             f"{', W' if len(kinds) == 3 else ''} once per micro-batch and chunk;"
                             f" missing {sorted(map(str, missing))}, "
                             f"extra {sorted(map(str, extra))}")
        position = {op: i for i, op in enumerate(ops)}
        for op in ops:
            before = {"B": "F", "W": "B"}.get(op.kind)
            if before and position[Op(before, *op[1:])] > position[op]:
                raise ValueError(f"stage {s} runs {op} before {Op(before, *op[1:])}: a backward "
                                 f"needs its forward (and W its B) first")
    simulate(schedule)          # raises when the stages wait on each other forever


class OpSpan(NamedTuple):
    """When one op ran on its stage (simulated units, or seconds from the step's start)."""

    op: Op
    start: float
    end: float


@dataclass
class PipelineTimeline:
    """Every stage's ops with their start and end: simulated (``simulate``) or measured
    (``labkit.parallel.pipeline.pipeline_parallel.measure_schedules``);
    ``labkit.course.plot.gantt_figure`` draws it."""

    name: str
    p: int
    m: int
    v: int
    stages: list                             # stages[s]: list of OpSpan, in running order
    held: list = field(default_factory=list)   # per stage: peak (micro-batch, chunk) pairs kept

    @property
    def makespan(self):
        """From the first op's start to the last op's end, over every stage."""
        return (max(span.end for spans in self.stages for span in spans)
                - min(span.start for spans in self.stages for span in spans))

    def busy(self, stage: int):
        return sum(span.end - span.start for span in self.stages[stage])

    @property
    def stage_idle(self) -> list:
        """Each stage's idle fraction of the makespan."""
        return [1 - self.busy(s) / self.makespan for s in range(self.p)]

    @property
    def idle_fraction(self):
        """The bubble: the share of p x makespan that no op filled (exact with Fractions)."""
        return 1 - sum(self.busy(s) for s in range(self.p)) / (self.p * self.makespan)


def _cost(durations, full_backward: bool) -> Callable:
    """(stage, op) -> duration. A full backward (B of a schedule without W) costs B + W."""
    if callable(durations):
        return durations
    d = {"F": 1, "B": 1, "W": 1, **(durations or {})}
    unknown = set(d) - set(KINDS)
    if unknown:
        raise ValueError(f"durations name op kinds F, B and W; got {sorted(unknown)}")
    d = {k: Fraction(x) if isinstance(x, int) else x for k, x in d.items()}
    return lambda stage, op: d[op.kind] + (d["W"] if full_backward and op.kind == "B" else 0)


def simulate(schedule: Schedule, durations=None) -> PipelineTimeline:
    """Place each stage's ops in order, each as early as its stage is free and its inputs exist.

    ``durations``: {"F", "B", "W": time per op} (default 1 each, so a full backward costs 2:
    T_F = T_B = T_W as Qi et al. assume), or a function (stage, op) -> time (measured).
    An F needs the previous virtual stage's F of its micro-batch; a B the next one's B (the
    last virtual stage, its own F); a W its own B. Integers give exact Fractions. Ops of one
    of ``schedule.groups`` reach other stages at the group's end.
    """
    p, v = schedule.p, schedule.v
    cost = _cost(durations, full_backward=not schedule.split_backward)
    last = p * v - 1
    done: dict = {}                                   # (kind, mb, virtual stage) -> when others see it
    ran: dict = {}                                    # ... -> when it ended, for its own stage
    ends = _group_ends(schedule)
    stages = [[] for _ in range(p)]
    next_op, free = [0] * p, [0] * p
    remaining = sum(len(ops) for ops in schedule.stages)
    while remaining:
        progressed = False
        for s, ops in enumerate(schedule.stages):
            while next_op[s] < len(ops):
                op = ops[next_op[s]]
                k = schedule.virtual_stage(s, op.chunk)
                needs = {"F": [("F", op.micro_batch, k - 1)] if k else [],
                         "B": [("F", op.micro_batch, k)]
                         + ([("B", op.micro_batch, k + 1)] if k < last else []),
                         "W": [("B", op.micro_batch, k)]}[op.kind]
                here = [n for n in needs
                        if n in ran and device_of(n[2], p, schedule.placement) == s]
                if any(n not in done and n not in here for n in needs):
                    break
                start = max([free[s]] + [ran[n] if n in here else done[n] for n in needs])
                end = start + cost(s, op)
                ran[(op.kind, op.micro_batch, k)] = free[s] = end
                stages[s].append(OpSpan(op, start, end))
                start_i, stop = ends.get((s, next_op[s]), (next_op[s], next_op[s] + 1))
                if next_op[s] == stop - 1:     # the action is over: its outputs leave
                    for span in stages[s][start_i - stop:]:
                        o = span.op
                        done[(o.kind, o.micro_batch, schedule.virtual_stage(s, o.chunk))] = end
                next_op[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {s: str(ops[next_op[s]]) for s, ops in enumerate(schedule.stages)
                     if next_op[s] < len(ops)}
            raise ValueError(f"schedule {schedule.name!r} deadlocks: each stage waits for an op "
                             f"another stage has not run (next ops {stuck}); reorder the lists")
    return PipelineTimeline(schedule.name, p, schedule.m, v, stages, schedule.peak_held())


def _group_ends(schedule: Schedule) -> dict:
    """(stage, op index) -> (start, stop) of the group it belongs to (ops outside groups: none)."""
    return {(s, i): (start, stop) for s, groups in enumerate(schedule.groups)
            for start, stop in groups for i in range(start, stop)}


def virtual_stage(stage: int, chunk: int, p: int, placement: str = "loop") -> int:
    """The virtual stage of ``stage``'s local ``chunk``: chunk c of stage s is c p + s, or in a V
    down the stages on chunk 0 and back up on chunk 1."""
    if placement == "v":
        return stage if chunk == 0 else 2 * p - 1 - stage
    return chunk * p + stage


def device_of(virtual: int, p: int, placement: str = "loop") -> int:
    """The stage (device) that runs virtual stage ``virtual``: ``virtual_stage`` inverted."""
    if placement == "v":
        return virtual if virtual < p else 2 * p - 1 - virtual
    return virtual % p


def zb_h1_bubble(p: int, m: int, t_f=1, t_b=1, t_w=1) -> float:
    """ZB-H1's idle fraction when T_W <= T_F, T_B (Qi et al., 2023, section 3.1): each stage
    idles (p - 1)(T_F + T_B - T_W) of a step of m(T_F + T_B + T_W) + that."""
    bubble = (p - 1) * (t_f + t_b - t_w)
    return bubble / (m * (t_f + t_b + t_w) + bubble)


def dualpipe_bubble(p: int, m: int, t_f=1, t_b=2, t_w=1, t_fb=None):
    """DualPipeV's idle fraction on p devices (2p chunks) by DeepSeek's formula, run as
    DeepSeek runs its pairs (both inputs first, both outputs after): each device idles
    (p - 1)(T_F&B + T_B - 3 T_W) of a step of 2m(T_F + T_B) + that, T_B a full backward and
    T_F&B an overlapped forward-and-backward pair (default T_F + T_B: nothing hidden)."""
    t_fb = t_f + t_b if t_fb is None else t_fb
    bubble = (p - 1) * (t_fb + t_b - 3 * t_w)
    return bubble / (2 * m * (t_f + t_b) + bubble)


def measured_durations(timeline: PipelineTimeline) -> Callable:
    """(stage, op) -> the median duration of that stage's ops of the same kind and chunk in a
    measured timeline: ``simulate(schedule, measured_durations(run.timeline))`` is the
    schedule's bubble with the real costs (unequal stages) but no time spent on messages."""
    groups: dict = {}
    for s, spans in enumerate(timeline.stages):
        for op, start, end in spans:
            groups.setdefault((s, op.kind, op.chunk), []).append(end - start)
    medians = {key: statistics.median(times) for key, times in groups.items()}
    return lambda stage, op: medians[stage, op.kind, op.chunk]
