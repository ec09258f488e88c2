"""The capstone planner: which layouts of a training run fit a cluster, ranked by step time.

``plan`` enumerates layouts - data parallel with ZeRO stage 0-3 (FSDP is ZeRO-3), ZeRO-Offload,
tensor parallel (with sequence parallelism), pipeline parallel and its schedule, expert parallel,
micro-batch size, recompute policy, and full fine-tuning, LoRA or QLoRA - predicts each one's
bytes per GPU with ``labkit.estimate``, keeps those under the GPU's memory less a headroom, and
ranks them by ``labkit.steptime``'s compute + communication model. Impossible or too-large
families are kept with the reason. The top layouts can be checked on fake tensors
(``measure_step`` on one GPU, FSDP2 on a fake process group for ZeRO-3).

The search stays fast by pruning: a family's model states (the same for every micro-batch and
recompute policy) are a lower bound computed without ``estimate``; the rest are estimated in
order of modelled step time until ``top`` fit, and a failure rules out every member of its
family that keeps more (a larger micro-batch, a weaker recompute policy) without estimating it.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

from .config import ModelConfig, preset
from .gpus import GPU, HEADROOM, gpu as gpu_named, usable_memory
from .layers import block_weights, count_params, embedding_weights, head_weights, layer_saved
from .parallel.schedules import chunk_layers, in_flight
from .parallel.zero import per_rank
from .predict import Estimate, estimate
from .recipe import FINE_TUNING, Layout, Recipe, fine_tuning_fields, state_bytes
from .steptime import StepTime, assumptions, step_time
from .units import CATEGORIES, check_choice, check_positive, fmt_bytes

TRAINABLE = FINE_TUNING
RECOMPUTE = ("none", "selective", "full")          # full recomputation keeps the least
SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))   # gpipe: 1f1b's bubble, more memory
OVERLAP_TIE = 0.01           # a layout this much faster or less does not overtake #1
HOST_USABLE = 0.8            # of a node's host memory, for ZeRO-Offload's pinned states
FULL, ADAPTERS = "bf16-master", "bf16"      # full: 2 + 2 + 12 B/param; LoRA: bf16 throughout


@dataclass(frozen=True)
class Family:
    """What a layout's model states depend on: everything but micro-batch, recompute, schedule."""

    trainable: str
    dp: int
    zero_stage: int
    offload: bool
    tp: int
    pp: int
    ep: int

    def label(self) -> str:
        what = {"all": "full", "lora": "LoRA", "qlora": "QLoRA"}[self.trainable]
        if self.trainable != "all" and self.zero_stage == 3:
            return f"{what}, frozen base sharded (FSDP2), dp {self.dp}"
        if self.trainable != "all":
            return f"{what}, one GPU per replica, dp {self.dp}"
        zero = f"ZeRO-{self.zero_stage}{'-Offload' if self.offload else ''}"
        return (f"{what}, {zero}, dp {self.dp}, tp {self.tp}, pp {self.pp}"
                + (f", ep {self.ep}" if self.ep > 1 else ""))


@dataclass
class Candidate:
    """One layout: its family, recipe, micro-batch, per-GPU bytes and modelled step time."""

    family: Family
    layout: Layout
    recipe: Recipe
    micro_batch: int
    micro_batches: int
    time: StepTime
    estimate: Estimate | None = None

    def label(self) -> str:
        sched = (f", {self.layout.schedule}" + (f" v{self.layout.virtual_stages}"
                                                if self.layout.virtual_stages > 1 else "")
                 if self.layout.pp > 1 else "")
        return (f"{self.family.label()}{sched}, mb {self.micro_batch} x {self.micro_batches}, "
                f"recompute {self.recipe.recompute}")

    def as_dict(self) -> dict:
        return {"label": self.label(), "family": self.family.label(),
                "layout": dict(vars(self.layout)), "recipe": dict(vars(self.recipe)),
                "micro_batch": self.micro_batch, "micro_batches": self.micro_batches,
                "time": self.time.as_dict(), "time_overlapped": self.time.overlapped,
                "memory": self.estimate.as_dict() if self.estimate else None}


@dataclass
class Plan:
    """``fits``: ranked candidates; ``rejected``: family label -> why it fails; ``unexplored``:
    families that may fit but whose fastest member is slower than the ``top`` found."""

    model: str
    gpu: GPU
    gpus: int
    gpus_per_node: int
    seq: int
    global_batch: int
    usable: int
    fits: list = field(default_factory=list)
    rejected: dict = field(default_factory=dict)
    unexplored: list = field(default_factory=list)
    assumptions: list = field(default_factory=list)
    verified: list = field(default_factory=list)
    advice: list = field(default_factory=list)
    overlap: str = ""          # does #1 stay first if communication overlaps compute?
    estimates: int = 0
    search_s: float = 0.0

    def text(self, max_rejected: int = 40) -> str:
        head = (f"{self.model} on {self.gpus} x {self.gpu.name} ({self.gpus_per_node} per node), "
                f"seq {self.seq}, global batch {self.global_batch} sequences; usable "
                f"{fmt_bytes(self.usable)} per GPU; searched in {self.search_s:.2f} s "
                f"({self.estimates} estimates)")
        short = {"params": "params", "grads": "grads", "optimizer": "optim",
                 "activations": "activ", "weight_cache": "wcache", "other": "other"}
        lines = [head, ""]
        if self.fits:
            cols = "".join(f"{short[k]:>11}" for k in CATEGORIES)
            lines.append(f"{'#':>2} {'step s':>8} {'':<2}{cols}{'total':>11}  layout")
            for i, c in enumerate(self.fits, 1):
                e = c.estimate
                lines.append(f"{i:>2} {c.time.total:>8.2f}   "
                             + "".join(f"{fmt_bytes(getattr(e, k), 1):>11}" for k in CATEGORIES)
                             + f"{fmt_bytes(e.total, 1):>11}  {c.label()}")
            best = self.fits[0].time
            lines.append("   step time of #1: " + ", ".join(
                f"{k} {v:.2f} s" for k, v in best.as_dict().items() if v and k != "total"))
            lines.append(f"   {self.overlap}")
        else:
            lines.append("nothing fits.")
        for v in self.verified:
            lines.append(f"   verified #{v['rank']}: {v['result']}")
        if self.advice:
            lines += ["", "what would fit:"] + [f"  - {a}" for a in self.advice]
        groups = self.rejected_by_reason()
        if groups:
            lines += ["", f"rejected families ({len(self.rejected)}), by reason:"]
        lines += [f"  - {g['count']} families, "
                  f"{'the nearest' if _first_bytes(g['example_reason']) < math.inf else 'e.g.'} "
                  f"{g['example']}: {g['example_reason']}" if g["count"] > 1 else
                  f"  - {g['example']}: {g['example_reason']}" for g in groups[:max_rejected]]
        if len(groups) > max_rejected:
            lines.append(f"  ... {len(groups) - max_rejected} more reasons (see --json)")
        if self.unexplored:
            lines.append(f"not estimated (their fastest layout is slower than the top "
                         f"{len(self.fits)}; model states fit): {len(self.unexplored)} families")
        lines += ["", "assumptions:"] + [f"  - {a}" for a in self.assumptions]
        return "\n".join(lines)

    def rejected_by_reason(self) -> list[dict]:
        """The rejected families grouped by reason, its numbers left out, most families first:
        ``reason`` (the pattern), ``count``, one ``example`` family and its ``example_reason``."""
        groups: dict[str, dict] = {}
        for family, why in self.rejected.items():
            kind = f"{family.split(',')[0]}: {_reason_kind(why)}"      # full / LoRA / QLoRA
            group = groups.setdefault(kind, dict(reason=kind, count=0, example=family,
                                                 example_reason=why))
            group["count"] += 1
            if _first_bytes(why) < _first_bytes(group["example_reason"]):   # the nearest miss
                group.update(example=family, example_reason=why)
        return sorted(groups.values(), key=lambda g: -g["count"])

    def as_dict(self) -> dict:
        return {"model": self.model, "gpu": self.gpu.as_dict(), "gpus": self.gpus,
                "gpus_per_node": self.gpus_per_node, "seq": self.seq,
                "global_batch": self.global_batch, "usable": self.usable,
                "fits": [c.as_dict() for c in self.fits], "rejected": self.rejected,
                "rejected_by_reason": self.rejected_by_reason(),
                "unexplored": self.unexplored, "assumptions": self.assumptions,
                "verified": self.verified, "advice": self.advice, "overlap": self.overlap,
                "estimates": self.estimates, "search_s": self.search_s}


_NUMBER = r"\d(?:[\d,.]*\d)?"
_BYTES = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _reason_kind(why: str) -> str:
    """A rejection's reason without its numbers: what groups it (the largest category and
    the peak's phase stay)."""
    return re.sub(_NUMBER + r"(\s*[KMGT]iB|\s*B\b)?", "#", why)


def _first_bytes(why: str) -> float:
    """The first size a reason names (what the family needs), or infinity."""
    found = re.search(r"(" + _NUMBER + r")\s*(B|[KMGT]iB)\b", why)
    return float(found.group(1).replace(",", "")) * _BYTES[found.group(2)] if found else math.inf


# ---- the search space --------------------------------------------------------------------
def _powers_of_two(limit: int) -> list[int]:
    return [2 ** k for k in range(limit.bit_length()) if 2 ** k <= limit]


def _families(c: ModelConfig, gpus: int, gpus_per_node: int, trainable, offload: bool):
    """Every family to consider, and the reasons of those that cannot exist."""
    out, impossible = [], {}
    for what in trainable:
        if what != "all":        # replicas (one GPU's step each); LoRA's base sharded by FSDP
            out.append(Family(what, gpus, 0, False, 1, 1, 1))
            if what == "lora" and gpus > 1:     # QLoRA's NF4 base: see predict's exclusions
                out.append(Family(what, gpus, 3, False, 1, 1, 1))
            continue
        for tp in _powers_of_two(min(gpus, 2 * gpus_per_node)):
            for pp in _powers_of_two(min(gpus // tp, c.layers)):
                if gpus % (tp * pp):
                    continue
                dp = gpus // (tp * pp)
                zeros = [(0, False)] + ([(z, False) for z in (1, 2, 3)] if dp > 1 else [])
                zeros += [(z, True) for z in (1, 2, 3)] if offload else []
                out += [Family("all", dp, z, off, tp, pp, 1) for z, off in zeros]
                # expert parallelism inside dp, without ZeRO or with ZeRO-1 (each expert
                # shard's states over its dp / ep copies: Megatron's distributed optimizer)
                if c.is_moe:
                    out += [Family("all", dp, z, False, tp, pp, e) for z in (0, 1)
                            for e in _powers_of_two(min(dp, c.routed_experts)) if e > 1]
    families = []
    for f in dict.fromkeys(out):
        why = _impossible(c, f, gpus_per_node)
        if why:
            impossible[f.label()] = why
        else:
            families.append(f)
    return families, impossible


def _impossible(c: ModelConfig, f: Family, gpus_per_node: int) -> str | None:
    """Why a family cannot be built, or None."""
    if f.tp > gpus_per_node:
        return (f"tp {f.tp} > {gpus_per_node} GPUs per node: tensor parallelism all-reduces in "
                f"every layer and must stay inside a node")
    try:
        Layout(dp=f.dp, zero_stage=f.zero_stage, offload=f.offload, tp=f.tp, pp=f.pp,
               ep=f.ep, sp=f.tp > 1).check(c, 1 << 20)
    except ValueError as error:
        return str(error)
    return None


# ---- cheap bounds: per-stage parameter counts, model states ------------------------------
class _Counts:
    """Parameters per pipeline stage on one rank (all, and routed experts'), memoised."""

    def __init__(self, c: ModelConfig):
        self.c, self.memo = c, {}

    def stages(self, tp: int, pp: int, ep: int, v: int = 1) -> list[tuple[int, int, int, int]]:
        """Per stage: (parameters, routed-expert parameters, layers, MoE layers) on one rank."""
        key = (tp, pp, ep, v)
        if key not in self.memo:
            c, out = self.c, []
            blocks = {m: block_weights(c, m) for m in (False, True)}
            for s, chunks in enumerate(chunk_layers(c.layers, pp, v)):
                layers = [i for chunk in chunks for i in chunk]
                ws = [w for i in layers for w in blocks[c.is_moe and i >= c.dense_layers]]
                ws += (embedding_weights(c) if s == 0 else []) + (head_weights(c) if s == pp - 1 else [])
                n = sum(w.local(tp, ep) for w in ws)
                experts = sum(w.local(tp, ep) for w in ws if w.copies > 1)
                moe = sum(c.is_moe and i >= c.dense_layers for i in layers)
                out.append((n, experts, len(layers), moe))
            self.memo[key] = out
        return self.memo[key]


def _states(counts: _Counts, f: Family, n: int, experts: int = 0) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes on the device of a rank holding ``n`` parameters,
    ``experts`` of them routed experts (ZeRO-1 with ep shards their states over dp / ep)."""
    if f.trainable != "all":                # the frozen weights (NF4: at least half a byte)
        return per_rank(n // 2 if f.trainable == "qlora" else 2 * n, "params", f.zero_stage,
                        f.dp), 0, 0
    b = state_bytes(FULL, "adamw")
    params = 0 if f.offload and f.zero_stage == 3 else per_rank(n * b.weights, "params",
                                                                f.zero_stage, f.dp)
    if f.offload:
        return params, 0, 0
    grads = per_rank(n * b.grads, "grads", f.zero_stage, f.dp)
    grads += n * b.grads if f.dp > 1 and f.zero_stage == 0 and f.ep == 1 else 0   # DDP buckets
    if f.ep > 1:
        return params, grads, (per_rank((n - experts) * b.optimizer, "optimizer", f.zero_stage,
                                        f.dp)
                               + per_rank(experts * b.optimizer, "optimizer", f.zero_stage,
                                          f.dp // f.ep))
    return params, grads, per_rank(n * b.optimizer, "optimizer", f.zero_stage, f.dp)


def _states_bound(counts: _Counts, f: Family) -> int:
    """Bytes per GPU of the busiest stage's model states alone: a lower bound on its peak
    (the optimizer step holds them all)."""
    return max(sum(_states(counts, f, n, e)) for n, e, _, _ in counts.stages(f.tp, f.pp, f.ep))


def _bound(c, k: Candidate, counts: _Counts, seq: int, memo: dict) -> int:
    """A lower bound on a candidate's peak without ``estimate``: the model states (the optimizer
    step), or the weights and optimizer state with every saved activation (backward's start)."""
    f, L = k.family, k.layout
    v = L.virtual_stages
    worst = 0
    for s, (n, experts, _, _) in enumerate(counts.stages(f.tp, f.pp, f.ep, v)):
        params, grads, opt = _states(counts, f, n, experts)
        acts = 0
        if f.trainable == "all":
            flight = in_flight(s, L.pp, L.micro_batch_count, L.schedule, v)
            for chunk in chunk_layers(c.layers, L.pp, v)[s]:
                for i in chunk:
                    moe = c.is_moe and i >= c.dense_layers
                    key = (moe, f.tp, f.ep, k.recipe.recompute)
                    if key not in memo:
                        memo[key] = layer_saved(c, FULL, moe, f.tp, k.recipe.recompute,
                                                f.tp > 1, f.ep).bytes(1, seq)
                    acts += memo[key] * k.micro_batch
            acts = int(acts * flight)
        worst = max(worst, params + grads + opt, params + opt + acts)
    return worst


def _candidates(c, f: Family, counts: _Counts, gpu: GPU, gpus, gpus_per_node, seq, batch,
                recomputes=RECOMPUTE):
    """Every member of a family (micro-batch x recompute x schedule) with its modelled time."""
    per_rank_batch = batch // f.dp
    lora = f.trainable != "all"
    recipe_kw = dict(precision=ADAPTERS if lora else FULL, **fine_tuning_fields(f.trainable))
    schedules = SCHEDULES if f.pp > 1 else (("1f1b", 1),)
    active = count_params(c).active - c.vocab_size * c.hidden   # the input embedding: a lookup
    out = []
    for schedule, v in schedules:
        if f.pp * v > c.layers:
            continue
        stages = counts.stages(f.tp, f.pp, f.ep, v)
        # the busiest stage for each kind of work: DeepSeek's first stage has the most layers
        # (its dense ones) but the fewest experts
        n, experts = max(stages, key=lambda s: s[0])[:2]
        layers, moe = max(s[2] for s in stages), max(s[3] for s in stages)
        frozen = 0
        if lora:         # adapters only: their all-reduce is negligible; ZeRO-3 gathers the base
            n, experts, frozen = 0, 0, n
        for micro in _powers_of_two(per_rank_batch):
            m = per_rank_batch // micro
            if per_rank_batch % micro or (schedule == "interleaved" and m % f.pp):
                continue
            layout = (Layout(dp=f.dp, zero_stage=f.zero_stage) if lora else
                      Layout(dp=f.dp, zero_stage=f.zero_stage, offload=f.offload, tp=f.tp,
                             sp=f.tp > 1, pp=f.pp, micro_batches=m if f.pp > 1 else None,
                             schedule=schedule, virtual_stages=v, ep=f.ep))
            for r in recomputes:
                t = step_time(gpu, gpus=gpus, gpus_per_node=gpus_per_node, active_params=active,
                              hidden=c.hidden, top_k=c.top_k, seq=seq, global_batch=batch,
                              micro=micro, dp=f.dp, tp=f.tp, pp=f.pp, ep=f.ep,
                              zero_stage=f.zero_stage, offload=f.offload, schedule=schedule,
                              v=v, recompute=r, lora=lora, rank_params=n - experts,
                              rank_expert_params=experts, stage_layers=layers,
                              stage_moe_layers=moe, frozen_params=frozen)
                out.append(Candidate(f, layout, Recipe(recompute=r, **recipe_kw), micro, m, t))
    return out


# ---- the search --------------------------------------------------------------------------
def _keeps_no_less(a: Candidate, b: Candidate) -> bool:
    """Whether ``a`` keeps at least what ``b`` keeps: same family and schedule, a micro-batch
    no smaller, and the same recompute policy or ``b``'s full recomputation, which keeps the
    least (so if ``b`` fails, ``a`` fails). Selective can keep more than none: with SDPA the
    checkpointed core's inputs are what SDPA would have saved, and LoRA's copies come on top."""
    return (a.family == b.family and a.layout.schedule == b.layout.schedule
            and a.micro_batch >= b.micro_batch
            and b.recipe.recompute in (a.recipe.recompute, "full"))


def _search(c, gpu: GPU, gpus, gpus_per_node, seq, batch, usable, trainable, offload, top,
            host_usable: int | None = None, recompute=RECOMPUTE):
    """(ranked fits, rejected {family: why}, unexplored families, estimates made). An
    offloaded layout also needs its ranks' pinned host memory within ``host_usable`` per node."""
    ranks_per_node = min(gpus, gpus_per_node)
    counts = _Counts(c)
    families, pool, rejected = _pool(c, counts, gpu, gpus, gpus_per_node, seq, batch, usable,
                                     trainable, offload, recompute)
    fits, failed, leanest = [], {}, {}      # failures by family; each family's smallest
    n_estimates, memo = 0, {}

    def fail(k, nbytes, why, bound=False):
        """Record a failure; a family's reason is its smallest estimated failure (a lower
        bound from a weaker recompute policy only when nothing was estimated)."""
        failed.setdefault(k.family, []).append(k)
        key = (bound, nbytes)
        if k.family not in leanest or key < leanest[k.family][0]:
            leanest[k.family] = (key, why)

    for k in pool:
        if top is not None and len(fits) >= top:
            break
        if any(_keeps_no_less(k, bad) for bad in failed.get(k.family, ())):
            continue
        bound = _bound(c, k, counts, seq, memo)
        if bound > usable:
            fail(k, bound, f"at least {fmt_bytes(bound)} per GPU (states and saved activations)"
                           f" > {fmt_bytes(usable)} usable at micro-batch {k.micro_batch}, "
                           f"recompute {k.recipe.recompute}", bound=True)
            continue
        n_estimates += 1
        try:
            k.estimate = estimate(c, k.micro_batch, seq, recipe=k.recipe, layout=k.layout)
        except ValueError as error:
            fail(k, 0, str(error))
            continue
        why = _why_not(k, usable, host_usable, ranks_per_node)
        if why is None:
            fits.append(k)
        else:
            fail(k, k.estimate.total, why)
    fitted = {k.family for k in fits}
    unexplored = []
    for f in families:
        if f in fitted or f.label() in rejected:
            continue
        members = [k for k in pool if k.family == f]
        if all(any(_keeps_no_less(k, bad) for bad in failed.get(f, ())) for k in members):
            rejected[f.label()] = leanest[f][1]
        else:
            unexplored.append(f.label())
    # equal modelled times (to the millisecond): the larger micro-batch, then the leaner layout
    fits.sort(key=lambda k: (round(k.time.total, 3), -k.micro_batch, k.estimate.total))
    return fits, rejected, unexplored, n_estimates


def _pool(c, counts: _Counts, gpu: GPU, gpus, gpus_per_node, seq, batch, usable, trainable,
          offload, recompute=RECOMPUTE):
    """(families, their candidates fastest first, rejected {family: why}): a family is
    rejected whole when the batch does not split over its dp or its states alone overflow."""
    families, rejected = _families(c, gpus, gpus_per_node, trainable, offload)
    pool = []
    for f in families:
        if batch % f.dp:
            rejected[f.label()] = (f"global batch {batch} does not split over dp {f.dp}: "
                                   f"choose a multiple of {f.dp}")
            continue
        bound = _states_bound(counts, f)
        if bound > usable:
            rejected[f.label()] = (f"model states alone need {fmt_bytes(bound)} per GPU > "
                                   f"{fmt_bytes(usable)} usable")
            continue
        pool += _candidates(c, f, counts, gpu, gpus, gpus_per_node, seq, batch, recompute)
    # fastest first; ties: the larger micro-batch
    pool.sort(key=lambda k: (round(k.time.total, 9), -k.micro_batch))
    return families, pool, rejected


def _why_not(k, usable: int, host_usable: int | None, ranks_per_node: int) -> str | None:
    """Why an estimated candidate does not fit (GPU memory, or an offload's pinned host
    memory per node), or None when it fits."""
    total = k.estimate.total
    if total > usable:
        return (f"{fmt_bytes(total)} per GPU > {fmt_bytes(usable)} usable at micro-batch "
                f"{k.micro_batch}, recompute {k.recipe.recompute} ({_largest(k.estimate)})")
    host = ranks_per_node * k.estimate.details.get("host memory", 0)
    if host_usable is not None and host > host_usable:
        ranks = f"{ranks_per_node} rank{'s' if ranks_per_node > 1 else ''}"
        return (f"{fmt_bytes(host)} of pinned host memory per node ({ranks}) > "
                f"{fmt_bytes(host_usable)} usable (host_ram, --host-ram)")
    return None


def _largest(e: Estimate) -> str:
    """The largest category at the peak, for a rejection's reason."""
    key = max(CATEGORIES, key=lambda k: getattr(e, k))
    return f"largest: {CATEGORIES[key]} {fmt_bytes(getattr(e, key))}, peak in the {e.peak_phase}"


def plan(model, gpu, gpus: int, gpus_per_node: int = 8, seq: int = 4096,
         global_batch: int | None = None, headroom: float = HEADROOM,
         trainable="all", offload: bool = True, top: int | None = 10, verify: int = 0,
         advice: bool = True, progress: bool = False, host_ram: int | None = None,
         recompute=RECOMPUTE) -> Plan:
    """Rank the layouts of one training step of ``model`` that fit ``gpus`` GPUs of type ``gpu``.

    ``model``: a preset name, a ``ModelConfig`` or a Hugging Face config; ``gpu``: a name in
    ``labkit.gpus.GPUS`` or a ``GPU``. ``global_batch``: sequences per optimizer step (default:
    one per GPU). ``headroom``: the fraction of memory kept free for what the estimate does not
    see (CUDA context, NCCL buffers, allocator fragmentation). ``top``: how many fitting layouts
    to find (None: all). ``verify``: check that many of the top layouts on fake tensors.
    ``host_ram``: bytes of host memory per node (default: the GPU type's ``host_ram_per_gpu``
    times the GPUs on a node); ZeRO-Offload's pinned states of a node's ranks must fit in
    HOST_USABLE of it. ``recompute``: the policies to search (a name or several of
    RECOMPUTE; LoRA and QLoRA are run with checkpointing, so every one by default).
    """
    start = time.perf_counter()
    c = _model(model)
    g = gpu_named(gpu)
    check_positive("gpus", gpus)
    check_positive("gpus_per_node", gpus_per_node)
    check_positive("seq", seq)
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise ValueError(f"gpus={gpus} spans nodes of {gpus_per_node}: choose a multiple of "
                         f"{gpus_per_node} (or set gpus_per_node)")
    batch = gpus if global_batch is None else global_batch
    check_positive("global_batch (sequences per step)", batch)
    trainable = (trainable,) if isinstance(trainable, str) else tuple(dict.fromkeys(trainable))
    for t in trainable:
        check_choice("trainable", t, TRAINABLE)
    recompute = (recompute,) if isinstance(recompute, str) else tuple(dict.fromkeys(recompute))
    for r in recompute:
        check_choice("recompute", r, RECOMPUTE)
    if not trainable or not recompute:
        raise ValueError("give at least one trainable (all, lora, qlora) and one recompute "
                         "policy (none, selective, full) to search")
    if seq > c.max_seq:
        c = c.replace(max_seq=seq)           # the RoPE tables cover the planned sequence
    usable = usable_memory(g, headroom)
    host_ram = (g.host_ram_per_gpu * min(gpus, gpus_per_node) if host_ram is None
                else check_positive("host_ram", host_ram))
    host_usable = int(host_ram * HOST_USABLE)
    # ZeRO-Offload only when nothing fits on the devices: its host-side step is not modelled
    fits, rejected, unexplored, n = _search(c, g, gpus, gpus_per_node, seq, batch, usable,
                                            trainable, False, top, recompute=recompute)
    if not fits and offload:
        fits, rejected, unexplored, more = _search(c, g, gpus, gpus_per_node, seq, batch,
                                                   usable, trainable, True, top, host_usable,
                                                   recompute)
        n += more
    out = Plan(c.name, g, gpus, min(gpus, gpus_per_node), seq, batch, usable, fits, rejected,
               unexplored, estimates=n)
    out.assumptions = [
        f"usable memory: {fmt_bytes(g.memory)} less {100 * headroom:g}% headroom for the CUDA "
        f"context, NCCL buffers and allocator fragmentation = {fmt_bytes(usable)}",
        f"full fine-tuning: {FULL} (2 + 2 + 12 bytes per parameter), AdamW foreach (CUDA's "
        f"default); LoRA/QLoRA: {ADAPTERS} rank-16 adapters on every linear of the blocks, "
        f"recompute {' / '.join(recompute)}, over dp only: each GPU a replica (DDP over the "
        f"adapters), or LoRA's frozen base sharded by FSDP2 (its backward prefetch and held "
        f"all-gather outputs counted; full fine-tuning's ZeRO-3 is labkit's, one unit gathered "
        f"at a time, which FSDP2 exceeds by up to ~4%); QLoRA under FSDP (torchao's NF4Tensor, "
        f"bitsandbytes' quant_storage) is not estimated",
        f"ZeRO-Offload: the pinned states of a node's ranks within {HOST_USABLE:.0%} of its "
        f"{fmt_bytes(host_ram)} of host memory (the rest for the OS and data loaders); its "
        f"CPU optimizer step is not timed",
        "searched: tp in powers of 2 inside a node (with sequence parallelism), pp in powers "
        "of 2 up to the layers, schedules 1f1b / interleaved (v 2) / zb-h1, ep in powers of 2 "
        "with ZeRO-0 or ZeRO-1 (each expert shard's states over its dp / ep copies), ZeRO 0-3 "
        f"and ZeRO-Offload (only when nothing fits without it), micro-batch in powers of 2, "
        f"recompute {' / '.join(recompute)}; not searched: context parallelism, gpipe (1f1b's "
        f"bubble with more memory), HSDP (shard inside a node, replicate across nodes), "
        f"FSDP-QLoRA, ep with ZeRO-2/3",
        *assumptions(g, gpus_per_node),
    ]
    out.overlap = _overlap_check(fits)
    if not fits and advice:
        out.advice = _advice(c, g, gpus, gpus_per_node, seq, batch, headroom, trainable,
                             offload, global_batch, host_ram, recompute)
    out.search_s = time.perf_counter() - start          # the search, not the verification
    if verify:
        out.verified = verify_candidates(c, fits[:verify], seq, progress)
    return out


def _model(model) -> ModelConfig:
    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, str):
        return preset(model)
    from .hf import from_hf_config
    return from_hf_config(model)


# ---- verification on fake tensors --------------------------------------------------------
def verify_candidates(c, candidates, seq: int, progress: bool = False) -> list[dict]:
    """Measure each candidate's step on fake tensors where one applies: a one-GPU step
    (``measure_step``), or ZeRO-3 over dp alone (FSDP2 on a fake process group)."""
    from tqdm.auto import tqdm

    from .measure import measure_step
    from .parallel.fsdp import fake_fsdp2_peak

    out = []
    for rank, k in enumerate(tqdm(candidates, desc="verifying on fake tensors",
                                  disable=not progress), 1):
        L, r, e = k.layout, k.recipe, k.estimate
        row = {"rank": rank, "label": k.label(), "estimated": e.total}
        if L == Layout() or (r.trainable == "lora" and L == Layout(dp=L.dp)):
            measured = measure_step(c, k.micro_batch, seq, r.precision, recompute=r.recompute,
                                    fake=True, device="cuda", trainable=r.trainable,
                                    lora_rank=r.lora_rank, weight_format=r.weight_format).total
            how = ("measure_step, one GPU" if L.dp == 1 else
                   "measure_step, one replica (DDP's adapter buckets not in it)")
        elif (L.tp, L.pp, L.ep, L.offload, L.zero_stage) == (1, 1, 1, False, 3):
            measured = fake_fsdp2_peak(c, L.dp, k.micro_batch, seq, r.precision,
                                       recompute=r.recompute, trainable=r.trainable,
                                       lora_rank=r.lora_rank)["peak"]
            how = f"FSDP2 on a fake group of {L.dp}"
        else:
            row["result"] = "not verifiable on fake tensors here (tp, pp, ep, DDP or offload)"
            out.append(row)
            continue
        row.update(measured=measured, ratio=measured / e.total,
                   result=f"{how}: measured {fmt_bytes(measured)} vs estimated "
                          f"{fmt_bytes(e.total)} ({100 * (measured / e.total - 1):+.1f}%)")
        out.append(row)
    return out


def _overlap_check(fits: list) -> str:
    """Whether the top layout stays first when data-, pipeline- and expert-parallel traffic
    overlaps compute (``StepTime.overlapped``), or which one overtakes it."""
    if not fits:
        return ""
    first = min(range(len(fits)), key=lambda i: (round(fits[i].time.overlapped, 3),
                                                 -fits[i].micro_batch, fits[i].estimate.total))
    hidden = ("with dp, pp and ep communication hidden under compute (tp's stays exposed)")
    if fits[first].time.overlapped >= (1 - OVERLAP_TIE) * fits[0].time.overlapped:
        first = 0                     # no more than 1% faster: a tie the model cannot break
    if first == 0:
        return (f"overlap: {hidden}, #1 stays first: no layout found is over "
                f"{OVERLAP_TIE:.0%} faster ({fits[0].time.overlapped:.2f} s a step against "
                f"{fits[0].time.total:.2f} s with none)")
    return (f"overlap: {hidden}, #{first + 1} becomes first ({fits[first].time.overlapped:.2f} s "
            f"against #1's {fits[0].time.overlapped:.2f} s): the ranking depends on how much "
            f"of the communication the framework overlaps")


# ---- when nothing fits -------------------------------------------------------------------
def _twice_the_gpus(n: int, gpus_per_node: int) -> int:
    """The next cluster size to try: twice as many GPUs, but never part of a second node
    (3 -> 6 -> 8 -> 16 with 8 per node)."""
    if 2 * n <= gpus_per_node:
        return 2 * n
    return max(gpus_per_node, 2 * (n // gpus_per_node) * gpus_per_node)


def _advice(c, g, gpus, gpus_per_node, seq, batch, headroom, trainable, offload,
            global_batch, host_ram, recompute=RECOMPUTE) -> list[str]:
    """What would fit, each found by the same search: more GPUs, QLoRA, offload, shorter seq."""
    def first_fit(**change):
        kw = dict(gpus=gpus, gpus_per_node=gpus_per_node, seq=seq, global_batch=global_batch,
                  headroom=headroom, trainable=trainable, offload=offload, host_ram=host_ram,
                  recompute=recompute)
        kw.update(change)
        found = plan(c, g, top=1, advice=False, **kw)
        return found.fits[0] if found.fits else None

    out = []
    if tuple(recompute) != RECOMPUTE:        # the policies left out may fit as they are
        k = first_fit(recompute=RECOMPUTE)
        if k:
            out.append(f"recompute {k.recipe.recompute} on these GPUs (only "
                       f"{' / '.join(recompute)} searched): {k.label()} "
                       f"({fmt_bytes(k.estimate.total)} per GPU)")
    n = gpus
    while n < 16384:
        n = _twice_the_gpus(n, gpus_per_node)
        k = first_fit(gpus=n)
        if k:
            out.append(f"{n} x {g.name}: {k.label()} ({fmt_bytes(k.estimate.total)} per GPU)")
            break
    if "qlora" not in trainable:
        k = first_fit(trainable=("qlora",))
        if k:
            out.append(f"QLoRA on these {gpus} GPUs: {k.label()} "
                       f"({fmt_bytes(k.estimate.total)} per GPU)")
    if not offload:
        k = first_fit(offload=True)
        if k:
            out.append(f"ZeRO-Offload on these GPUs: {k.label()}")
    s = seq // 2
    while s >= 256:
        k = first_fit(seq=s)
        if k:
            out.append(f"seq {s} (micro-batch 1 at seq {seq} is already too large): {k.label()}")
            break
        s //= 2
    if not out:
        out.append("nothing found: up to 16,384 GPUs, QLoRA, offload or a shorter sequence")
    return out
