"""The capstone planner: which layouts of a training run fit a cluster, ranked by step time.

``plan`` enumerates layouts - data parallel with ZeRO stage 0-3 (FSDP is ZeRO-3), ZeRO-Offload,
tensor parallel (with sequence parallelism), pipeline parallel and its schedule, expert parallel,
context parallel (long sequences), micro-batch size, recompute policy, and full fine-tuning, LoRA
or QLoRA - predicts each one's
bytes per GPU with ``labkit.estimate``, keeps those under the GPU's memory less a headroom, and
ranks them by ``labkit.predict.steptime``'s compute + communication model. Impossible or too-large
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
from dataclasses import dataclass, field, replace

from labkit.core.config import ModelConfig, preset
from labkit.core.gpus import GPU, HEADROOM, gpu as gpu_named, usable_memory
from labkit.core.recipe import FINE_TUNING, Layout
from labkit.core.units import CATEGORIES, check_choice, check_positive, fmt_bytes
from labkit.predict.plan_search import (ADAPTERS, CP_MIN_TOKENS, FULL, OPTIMIZERS, RECOMPUTE,
                                       _search)
from labkit.predict.steptime import assumptions

TRAINABLE = FINE_TUNING
OVERLAP_TIE = 0.01           # a layout this much faster or less does not overtake #1
HOST_USABLE = 0.8            # of a node's host memory, for ZeRO-Offload's pinned states


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

    def text(self, max_rejected: int = 40, clock: bool = True) -> str:
        searched = f"searched in {self.search_s:.2f} s " if clock else "searched "
        head = (f"{self.model} on {self.gpus} x {self.gpu.name} ({self.gpus_per_node} per node), "
                f"seq {self.seq}, global batch {self.global_batch} sequences; usable "
                f"{fmt_bytes(self.usable)} per GPU; {searched}({self.estimates} estimates)")
        short = {"params": "params", "grads": "grads", "optimizer": "optim",
                 "activations": "activ", "weight_cache": "wcache", "other": "other"}
        lines = [head, ""]
        if self.fits:
            cols = "".join(f"{short[k]:>11}" for k in CATEGORIES)
            lines.append(f"{'#':>2} {'step s':>8} {'':<2}{cols}{'total':>11}  layout")
            for i, c in enumerate(self.fits, 1):
                e = c.estimate
                lines.append(f"{i:>2} {c.time.dp_overlapped:>8.2f}   "
                             + "".join(f"{fmt_bytes(getattr(e, k), 1):>11}" for k in CATEGORIES)
                             + f"{fmt_bytes(e.total, 1):>11}  {c.label()}")
            best = self.fits[0].time
            lines.append("   step time of #1 (dp's communication hidden under the compute, as "
                         "DDP and FSDP run it): " + ", ".join(
                f"{k} {v:.2f} s" for k, v in best.as_dict().items() if v and k != "total"))
            lines.append(f"   {self.overlap}")
            if any(c.family.trainable == "qlora" for c in self.fits):
                lines.append("   QLoRA as qlora.py runs it (bf16 adapters and embeddings); "
                             "Hugging Face + PEFT keeps them in fp32 and needs about a fifth more "
                             "per token: estimate it with labkit.course.published.HF_QLORA "
                             "(lab 09)")
        else:
            lines.append("nothing fits.")
        for v in self.verified:
            lines.append(f"   verified #{v['rank']}: {v['result']}")
        if self.advice:
            head = "what would fit on the GPUs alone (faster):" if self.fits else "what would fit:"
            lines += ["", head] + [f"  - {a}" for a in self.advice]
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


def plan(model, gpu, gpus: int, gpus_per_node: int = 8, seq: int = 4096,
         global_batch: int | None = None, headroom: float = HEADROOM,
         trainable="all", offload: bool = True, top: int | None = 10, verify: int = 0,
         advice: bool = True, progress: bool = False, host_ram: int | None = None,
         recompute=RECOMPUTE, host_gbps: float | None = None, optimizer="adamw") -> Plan:
    """Rank the layouts of one training step of ``model`` that fit ``gpus`` GPUs of type ``gpu``.

    ``model``: a preset name, a ``ModelConfig`` or a Hugging Face config; ``gpu``: a name in
    ``labkit.core.gpus.GPUS`` or a ``GPU``. ``global_batch``: sequences per optimizer step (default:
    one per GPU). ``headroom``: the fraction of memory kept free for what the estimate does not
    see (CUDA context, NCCL buffers, allocator fragmentation). ``top``: how many fitting layouts
    to find (None: all). ``verify``: check that many of the top layouts on fake tensors.
    ``host_ram``: bytes of host memory per node (default: the GPU type's ``host_ram_per_gpu``
    times the GPUs on a node); ZeRO-Offload's pinned states of a node's ranks must fit in
    HOST_USABLE of it. ``recompute``: the policies to search (a name or several of
    RECOMPUTE; LoRA and QLoRA are run with checkpointing, so every one by default).
    ``host_gbps``: GB/s of host memory bandwidth per node (default: the GPU type's
    ``host_gbps`` times the GPUs on a node), shared by the node's ranks' CPU optimizer steps.
    ``optimizer``: full fine-tuning's, one or several of ``OPTIMIZERS`` ("adamw": CUDA's default
    foreach; "adamw-8bit": 8-bit moments change the training's numbers, so it is searched only
    when asked for; "adamw-fused": ``fused=True``, also searched when nothing fits with
    foreach; on a tie AdamW ranks first). When only ZeRO-Offload fits, the advice says what
    would fit on the GPUs instead.
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
    optimizers = (optimizer,) if isinstance(optimizer, str) else tuple(dict.fromkeys(optimizer))
    for o in optimizers:
        check_choice("optimizer", o, OPTIMIZERS)
    if not trainable or not recompute or not optimizers:
        raise ValueError("give at least one trainable (all, lora, qlora), one recompute "
                         "policy (none, selective, full) and one optimizer (adamw, adamw-8bit, "
                         "adamw-fused) to search")
    if seq > c.max_seq:
        c = c.replace(max_seq=seq)           # the RoPE tables cover the planned sequence
    usable = usable_memory(g, headroom)
    asked = dict(gpu=g, host_ram=host_ram, host_gbps=host_gbps)   # the advice scales its own
    host_ram = (g.host_ram_per_gpu * min(gpus, gpus_per_node) if host_ram is None
                else check_positive("host_ram", host_ram))
    host_usable = int(host_ram * HOST_USABLE)
    if host_gbps is not None:             # the node's bandwidth, shared by its ranks
        if isinstance(host_gbps, bool) or not isinstance(host_gbps, (int, float)) \
                or not 0 < host_gbps < math.inf:
            raise ValueError(f"host_gbps is the node's DRAM bandwidth in GB/s, a positive "
                             f"number (e.g. 409.6), got {host_gbps!r}")
        g = replace(g, host_gbps=host_gbps / min(gpus, gpus_per_node))
    (fits, rejected, unexplored, n), optimizers = _search_in_turn(
        c, g, gpus, gpus_per_node, seq, batch, usable, trainable, offload, top, host_usable,
        recompute, optimizers)
    out = Plan(c.name, g, gpus, min(gpus, gpus_per_node), seq, batch, usable, fits, rejected,
               unexplored, estimates=n)
    out.assumptions = _assumptions(g, gpus_per_node, usable, headroom, host_ram, recompute,
                                   optimizers)
    out.overlap = _overlap_check(fits)
    if advice and (not fits or fits[0].layout.offload):
        # an offloaded fit runs at the host's pace: the advice is what fits on the GPUs
        out.advice = _advice(c, asked, gpus, gpus_per_node, seq, batch, headroom, trainable,
                             offload, global_batch, recompute, optimizers, bool(fits))
    out.search_s = time.perf_counter() - start          # the search, not the verification
    if verify:
        out.verified = verify_candidates(c, fits[:verify], seq, progress)
    return out


def _search_in_turn(c, g, gpus, gpus_per_node, seq, batch, usable, trainable, offload, top,
                    host_usable, recompute, optimizers):
    """((fits, rejected, unexplored, estimates), the optimizers searched): foreach AdamW first;
    fused AdamW only when nothing fits with foreach (CUDA's default, the same modelled time);
    ZeRO-Offload only when nothing fits on the devices (it is never faster)."""
    found = _search(c, g, gpus, gpus_per_node, seq, batch, usable, trainable, False, top,
                    recompute=recompute, optimizers=optimizers)
    n = found[3]
    fused = ("adamw-fused",) if "adamw" in optimizers and "adamw-fused" not in optimizers \
        and "all" in trainable else ()
    if not found[0] and fused:
        found = _search(c, g, gpus, gpus_per_node, seq, batch, usable, trainable, False, top,
                        recompute=recompute, optimizers=optimizers + fused)
        n += found[3]
        optimizers = optimizers + fused if found[0] else optimizers
    if not found[0] and offload:
        found = _search(c, g, gpus, gpus_per_node, seq, batch, usable, trainable, True, top,
                        host_usable, recompute, optimizers)
        n += found[3]
    return (*found[:3], n), optimizers


def _assumptions(g, gpus_per_node: int, usable: int, headroom: float, host_ram: int,
                 recompute, optimizers=("adamw",)) -> list[str]:
    """What the plan assumes, in words: memory, recipes, offload, the search, the time model."""
    return [
        f"usable memory: {fmt_bytes(g.memory)} less {100 * headroom:g}% headroom for the CUDA "
        f"context, NCCL buffers and allocator fragmentation = {fmt_bytes(usable)}",
        f"full fine-tuning: {FULL} (2 + 2 + 12 bytes per parameter, with ZeRO's gradient "
        f"shards in fp32: ZeRO-3 keeps (2 + 4 + 12) / N, FSDP2's MixedPrecisionPolicy "
        f"(4 + 4 + 8) / N), AdamW foreach, "
        f"torch.optim's CUDA default (Megatron-LM and DeepSpeed run a fused Adam)"
        + (f", or 8-bit AdamW (2 + 2 + 6: its moments 1 byte each, as bitsandbytes' "
           f"and labkit's AdamW8bit keep them; its block scales not counted, its "
           f"step's time the same as AdamW's)" if "adamw-8bit" in optimizers else
           "; 8-bit AdamW only when asked for (--optimizer adamw-8bit)")
        + ("; fused AdamW (fused=True: no step temporaries, the same numbers), searched when "
           "asked for or when nothing fits with foreach" if "adamw-fused" in optimizers else "")
        + f"; LoRA/QLoRA: {ADAPTERS} rank-16 adapters on every linear of the blocks but the "
        f"routed experts, which labkit stacks and neither adapts nor quantises "
        f"(the embeddings, head and adapters in bf16, as QLoRA's qlora.py casts them; Hugging "
        f"Face's prepare_model_for_kbit_training keeps them in fp32 and needs more: estimate "
        f"such a run with labkit.course.published.HF_QLORA, lab 09), "
        f"recompute {' / '.join(recompute)}: each GPU a replica (DDP over the adapters); the "
        f"frozen base sharded over dp by FSDP2 (QLoRA's NF4 codes and scales as bytes, as "
        f"bitsandbytes' quant_storage lets FSDP do: FSDP-QLoRA; its backward prefetch and held "
        f"all-gather outputs counted; full fine-tuning's ZeRO-3 is labkit's, one unit gathered "
        f"at a time, which FSDP2 exceeds by up to ~4%), offloaded if nothing fits without; or, "
        f"LoRA only, the bf16 base split by tp, pp (1f1b or interleaved: a frozen base has no "
        f"weight-gradient work for zb-h1's bubble) or ep, the adapters replicated over the rest, "
        f"as Megatron's and NeMo's parallel adapters run it (bitsandbytes' NF4 has no tensor-, "
        f"pipeline- or expert-parallel engine)",
        f"ZeRO-Offload: the pinned states of a node's ranks within {HOST_USABLE:.0%} of its "
        f"{fmt_bytes(host_ram)} of host memory (the rest for the OS and data loaders); its "
        f"CPU optimizer step timed (below)",
        "searched: tp in powers of 2 inside a node (with sequence parallelism), pp in powers "
        "of 2 up to the layers, schedules 1f1b / interleaved (v 2) / zb-h1 (as labkit's "
        "executor runs it: a deferred W keeps its micro-batch's whole graph; one that keeps "
        "only each linear's input and output gradient needs less), ep in powers of 2 "
        "(each expert shard's states over its dp / ep copies), ZeRO 0-3 and ZeRO-Offload "
        f"(only when nothing fits without it; not with ep), micro-batch in powers of 2, "
        f"cp (ring attention) in powers of 2 while each rank keeps {CP_MIN_TOKENS:,} tokens or "
        f"more (full fine-tuning, not with ep), HSDP (ZeRO 1-3 inside a node's data ranks, "
        f"replicated across nodes; full fine-tuning, not with ep or offload), recompute "
        f"{' / '.join(recompute)}; not searched: Ulysses, gpipe (1f1b's bubble with more "
        f"memory), LoRA's base split and sharded at once",
        *assumptions(g, gpus_per_node),
    ]


def _model(model) -> ModelConfig:
    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, str):
        return preset(model)
    from labkit.core.hf import from_hf_config
    return from_hf_config(model)


# ---- verification on fake tensors --------------------------------------------------------
def verify_candidates(c, candidates, seq: int, progress: bool = False) -> list[dict]:
    """Measure each candidate's step on fake tensors where one applies: a one-GPU step
    (``measure_step``), or ZeRO-3 over dp alone (FSDP2 on a fake process group)."""
    from tqdm.auto import tqdm

    from labkit.training.measure import measure_step
    from labkit.parallel.data.fsdp import fake_fsdp2_peak

    out = []
    for rank, k in enumerate(tqdm(candidates, desc="verifying on fake tensors",
                                  disable=not progress), 1):
        L, r, e = k.layout, k.recipe, k.estimate
        row = {"rank": rank, "label": k.label(), "estimated": e.total}
        if L == Layout() or (r.trainable == "lora" and L == Layout(dp=L.dp)):
            measured = measure_step(c, k.micro_batch, seq, r.precision, r.optimizer,
                                    recompute=r.recompute, optimizer_impl=r.optimizer_impl,
                                    fake=True, device="cuda", trainable=r.trainable,
                                    lora_rank=r.lora_rank, weight_format=r.weight_format).total
            how = ("measure_step, one GPU" if L.dp == 1 else
                   "measure_step, one replica (DDP's adapter buckets not in it)")
        elif ((L.tp, L.pp, L.ep, L.cp, L.offload, L.zero_stage) == (1, 1, 1, 1, False, 3)
              and r.optimizer == "adamw" and r.optimizer_impl is None):   # FSDP2's: foreach
            measured = fake_fsdp2_peak(c, L.dp, k.micro_batch, seq, r.precision,
                                       recompute=r.recompute, trainable=r.trainable,
                                       lora_rank=r.lora_rank)["peak"]
            how = f"FSDP2 on a fake group of {L.dp}"
        else:
            row["result"] = ("not verifiable on fake tensors here (tp, pp, ep, cp, DDP, offload, "
                             "or 8-bit or fused AdamW under FSDP2)")
            out.append(row)
            continue
        row.update(measured=measured, ratio=measured / e.total,
                   result=f"{how}: measured {fmt_bytes(measured)} vs estimated "
                          f"{fmt_bytes(e.total)} ({100 * (measured / e.total - 1):+.1f}%)")
        out.append(row)
    return out


def _overlap_check(fits: list) -> str:
    """Whether the top layout (ranked with data-parallel traffic hidden as frameworks do by
    default) stays first when all of dp's, pp's and ep's traffic overlaps compute
    (``StepTime.overlapped``), or which one overtakes it."""
    if not fits:
        return ""
    first = min(range(len(fits)), key=lambda i: (round(fits[i].time.overlapped, 3),
                                                 -fits[i].micro_batch, fits[i].estimate.total))
    hidden = ("with all of dp's, pp's and ep's communication hidden under compute (DualPipe, "
              "Megatron's overlap options) and cp's under attention (tp's, offload's and the "
              "host step stay exposed)")
    if fits[first].time.overlapped >= (1 - OVERLAP_TIE) * fits[0].time.overlapped:
        first = 0                     # no more than 1% faster: a tie the model cannot break
    if first == 0:
        return (f"overlap: {hidden}, #1 stays first: no layout found is over "
                f"{OVERLAP_TIE:.0%} faster ({fits[0].time.overlapped:.2f} s a step against "
                f"{fits[0].time.dp_overlapped:.2f} s as ranked)")
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


def _advice(c, asked, gpus, gpus_per_node, seq, batch, headroom, trainable, offload,
            global_batch, recompute=RECOMPUTE, optimizers=("adamw",),
            offloaded_fit: bool = False) -> list[str]:
    """What would fit, each found by the same search: more GPUs, QLoRA, offload, shorter seq.
    ``asked``: the GPU type and host figures as the caller gave them (a default host memory
    and bandwidth grow with the GPUs tried, as they do for a plan of that many).
    ``offloaded_fit``: only ZeRO-Offload fits, so what would fit on the GPUs alone."""
    g, searched_offload = asked["gpu"], offload
    here = "this GPU" if gpus == 1 else f"these {gpus} GPUs"
    offload = offload and not offloaded_fit

    def first_fit(**change):
        kw = dict(gpus=gpus, gpus_per_node=gpus_per_node, seq=seq, global_batch=global_batch,
                  headroom=headroom, trainable=trainable, offload=offload,
                  host_ram=asked["host_ram"], host_gbps=asked["host_gbps"],
                  recompute=recompute, optimizer=optimizers)
        kw.update(change)
        found = plan(c, g, top=1, advice=False, **kw)
        return found.fits[0] if found.fits else None

    out = []
    if tuple(recompute) != RECOMPUTE:        # the policies left out may fit as they are
        k = first_fit(recompute=RECOMPUTE)
        if k:
            out.append(f"recompute {k.recipe.recompute} on {here} (only "
                       f"{' / '.join(recompute)} searched): {k.label()} "
                       f"({fmt_bytes(k.estimate.total)} per GPU)")
    n, wanted = gpus, offload    # the fewest GPUs; with offload, also the fewest without
    while n < 16384 and wanted is not None:
        n = _twice_the_gpus(n, gpus_per_node)
        k = first_fit(gpus=n, offload=wanted)
        if k:
            out.append(f"{n} x {g.name}: {k.label()} ({fmt_bytes(k.estimate.total)} per GPU, "
                       f"{k.time.dp_overlapped:.2f} s a step of {global_batch or n} sequences "
                       f"modelled)")
            wanted = False if k.layout.offload else None
    if "all" in trainable and "adamw-8bit" not in optimizers:
        k = first_fit(optimizer=("adamw-8bit",))
        if k:
            out.append(f"8-bit AdamW on {here}: {k.label()} "
                       f"({fmt_bytes(k.estimate.total)} per GPU)")
    if "qlora" not in trainable:
        k = first_fit(trainable=("qlora",))
        if k:
            out.append(f"QLoRA on {here}: {k.label()} "
                       f"({fmt_bytes(k.estimate.total)} per GPU)")
    if not searched_offload:
        k = first_fit(offload=True)
        if k:
            out.append(f"ZeRO-Offload on {here}: {k.label()}")
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
