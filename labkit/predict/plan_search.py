"""The planner's search: the families of layouts a cluster allows, a cheap lower bound on each
one's bytes (its model states, without ``estimate``), its members (micro-batch x recompute x
schedule) with their modelled step times, and the search that estimates them fastest first
until enough fit, ruling out what keeps no less than a failure."""
from __future__ import annotations

from dataclasses import replace

from labkit.core.config import ModelConfig
from labkit.core.gpus import GPU
from labkit.core.recipe import (SPLIT_BACKWARD, Layout, Recipe, fine_tuning_fields, placement_of,
                                state_bytes)
from labkit.core.units import CATEGORIES, fmt_bytes
from labkit.parallel.data.zero import per_rank
from labkit.parallel.pipeline.schedules import chunk_layers, in_flight
from labkit.predict import Estimate, estimate
from labkit.predict.formats import nf4_bits_per_param
from labkit.predict.layers import (block_weights, count_params, embedding_weights, head_weights,
                                   layer_saved, lora_targets)
from labkit.predict.plan_family import ADAPTERS, FULL, Candidate, Family  # noqa: F401 (re-exported)
from labkit.predict.steptime import attention_forward_flops, step_time

RECOMPUTE = ("none", "selective", "full")          # full recomputation keeps the least
# (schedule, chunks per stage) the search tries; not GPipe: 1F1B's bubble with more memory
SEARCHED_SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 1))
TIE = 0.02           # modelled step times this close (relative) are a tie the model cannot break
# context parallelism is searched while each rank keeps this many tokens or more: a practical
# floor (Llama 3 trained at 128k tokens with cp 16: 8k per rank). Across nodes a grouped-KV
# model's K/V hop outlasts the attention it hides behind below about this many tokens (Llama-3-8B
# on H100s: ~4k); inside a node, or with more key/value heads, the break-even differs
CP_MIN_TOKENS = 4096
# full fine-tuning's optimizers to try: AdamW (CUDA's default foreach), 8-bit AdamW (its moments
# in 1 byte each; labkit's AdamW8bit, as bitsandbytes'), fused AdamW (no step temporaries)
OPTIMIZERS = ("adamw", "adamw-8bit", "adamw-fused")


# ---- the search space --------------------------------------------------------------------
def _powers_of_two(limit: int) -> list[int]:
    return [2 ** k for k in range(limit.bit_length()) if 2 ** k <= limit]


def context_degrees(seq: int, gpus: int) -> list[int]:
    """The cp the search tries: 1, and powers of 2 leaving each rank ``CP_MIN_TOKENS`` or more
    (the ring's zigzag split needs seq divisible by 2 cp)."""
    return [cp for cp in _powers_of_two(gpus)
            if cp == 1 or (seq // cp >= CP_MIN_TOKENS and seq % (2 * cp) == 0)]


def _families(c: ModelConfig, gpus: int, gpus_per_node: int, trainable, offload: bool,
              seq: int = 0, optimizers=("adamw",)):
    """Every family to consider, and the reasons of those that cannot exist."""
    out, impossible = [], {}
    for what in trainable:
        if what != "all":        # replicas (one GPU's step each), or the frozen base (QLoRA's
            out.append(Family(what, gpus, 0, False, 1, 1, 1))       # NF4) sharded by FSDP2
            # (or on one GPU kept in host memory: FSDP2's CPUOffloadPolicy, DeepSpeed's
            # offload_param)
            out += [Family(what, gpus, 3, off, 1, 1, 1) for off in (False, True)[:1 + offload]
                    if gpus > 1 or off]
            out += _split_adapters(c, gpus, gpus_per_node) if what == "lora" else []
            continue
        for tp in _powers_of_two(min(gpus, 2 * gpus_per_node)):
            for pp in _powers_of_two(min(gpus // tp, c.layers)):
                for cp in context_degrees(seq, gpus // (tp * pp)):
                    if gpus % (tp * pp * cp):
                        continue
                    dp = gpus // (tp * pp * cp)
                    # ZeRO over dp x cp, as Megatron's distributed optimizer shards
                    zeros = [(0, False)] + ([(z, False) for z in (1, 2, 3)] if dp * cp > 1 else [])
                    # offload at one data rank: ZeRO-1 and -2 both offload the optimizer only
                    zeros += [(z, True) for z in ((1, 2, 3) if dp * cp > 1 else (2, 3))
                              ] if offload else []
                    out += [Family("all", dp, z, off, tp, pp, 1, cp) for z, off in zeros]
                    out += _hybrid(dp, tp, pp, cp, gpus_per_node)
                    # expert parallelism inside dp, with ZeRO 0-3: each expert shard's states
                    # over its dp / ep copies (Megatron's distributed optimizer, FSDP over
                    # experts); not with cp
                    if c.is_moe and cp == 1:
                        out += [Family("all", dp, z, False, tp, pp, e) for z in (0, 1, 2, 3)
                                for e in _powers_of_two(min(dp, c.routed_experts)) if e > 1]
    # full fine-tuning with each optimizer asked for (LoRA's adapters: AdamW, their states tiny)
    # (not offloaded: a host step runs AdamW, DeepSpeed's CPU Adam has no 8-bit state, and
    # its own implementation)
    out = [replace(f, optimizer=o) for f in out
           for o in (optimizers if f.trainable == "all" and not f.offload else ("adamw",))]
    families = []
    for f in dict.fromkeys(out):
        why = _impossible(c, f, gpus_per_node)
        if why:
            impossible[f.label()] = why
        else:
            families.append(f)
    return families, impossible


def _hybrid(dp: int, tp: int, pp: int, cp: int, gpus_per_node: int) -> list[Family]:
    """HSDP: ZeRO 1-3 sharded over one node's data ranks (gpus_per_node / tp of them) and
    replicated across nodes, where the data ranks span more than a node."""
    shard = gpus_per_node // tp
    if shard < 2 or dp * cp <= shard or (dp * cp) % shard:
        return []
    return [Family("all", dp, z, False, tp, pp, 1, cp, replicas=dp * cp // shard)
            for z in (1, 2, 3)]


def _split_adapters(c: ModelConfig, gpus: int, gpus_per_node: int) -> list[Family]:
    """LoRA's bf16 base split by tp (inside a node), pp or ep (MoE), as Megatron's and NeMo's
    parallel adapters run it, the adapters replicated over the dp that is left. Not QLoRA:
    bitsandbytes' NF4 weights have no tensor-, pipeline- or expert-parallel engine there, and
    FSDP-QLoRA shards over dp (the families above)."""
    out = []
    for tp in _powers_of_two(min(gpus, gpus_per_node)):
        for pp in _powers_of_two(min(gpus // tp, c.layers)):
            for ep in _powers_of_two(min(gpus // (tp * pp), c.routed_experts or 1)):
                if tp * pp * ep > 1 and gpus % (tp * pp) == 0:
                    out.append(Family("lora", gpus // (tp * pp), 0, False, tp, pp, ep))
    return out


def _impossible(c: ModelConfig, f: Family, gpus_per_node: int) -> str | None:
    """Why a family cannot be built, or None."""
    if f.tp > gpus_per_node:
        return (f"tp {f.tp} > {gpus_per_node} GPUs per node: tensor parallelism all-reduces in "
                f"every layer and must stay inside a node")
    try:
        Layout(dp=f.dp, zero_stage=f.zero_stage, offload=f.offload, tp=f.tp, pp=f.pp,
               ep=f.ep, cp=f.cp, sp=f.tp > 1, replicas=f.replicas).check(c, 1 << 20)
    except ValueError as error:
        return str(error)
    return None


# ---- cheap bounds: per-stage parameter counts, model states ------------------------------
class _Counts:
    """Parameters per pipeline stage on one rank (all, and routed experts'), memoised."""

    def __init__(self, c: ModelConfig):
        self.c, self.memo = c, {}
        # what the step time's compute counts: active parameters less the input embedding
        self.active = count_params(c).active - c.vocab_size * c.hidden

    def stages(self, tp: int, pp: int, ep: int, v: int = 1,
               placement: str = "loop") -> list[tuple[int, int, int, int, int]]:
        """Per stage: (parameters, routed-expert parameters, layers, MoE layers, the blocks'
        linears QLoRA stores in NF4) on one rank; in a V (``placement``) stage 0 ends the model."""
        key = (tp, pp, ep, v, placement)
        if key not in self.memo:
            c, out = self.c, []
            blocks = {m: block_weights(c, m) for m in (False, True)}
            targets = {m: sum(w.local(tp, ep) for w in lora_targets(c, m)) for m in (False, True)}
            last = 0 if placement == "v" else pp - 1
            for s, chunks in enumerate(chunk_layers(c.layers, pp, v, placement)):
                layers = [i for chunk in chunks for i in chunk]
                ws = [w for i in layers for w in blocks[c.is_moe and i >= c.dense_layers]]
                ws += (embedding_weights(c) if s == 0 else []) + (head_weights(c) if s == last else [])
                n = sum(w.local(tp, ep) for w in ws)
                experts = sum(w.local(tp, ep) for w in ws if w.copies > 1)
                moe = sum(c.is_moe and i >= c.dense_layers for i in layers)
                nf4 = sum(targets[c.is_moe and i >= c.dense_layers] for i in layers)
                out.append((n, experts, len(layers), moe, nf4))
            self.memo[key] = out
        return self.memo[key]


def _states(counts: _Counts, f: Family, n: int, experts: int = 0) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes on the device of a rank holding ``n`` parameters,
    ``experts`` of them routed experts (ZeRO shards their states over dp / ep, the rest over
    dp x cp)."""
    if f.trainable != "all":   # the frozen weights (NF4: at least half a byte; offloaded: host)
        frozen = 0 if f.offload else (n // 2 if f.trainable == "qlora" else 2 * n)
        return per_rank(frozen, "params", f.zero_stage, f.dp), 0, 0

    def sharded(number: int, state: str) -> int:
        rest = n - experts if f.ep > 1 else n
        return (per_rank(rest * number, state, f.zero_stage, f.shard_ranks)
                + (per_rank(experts * number, state, f.zero_stage, f.dp // f.ep)
                   if f.ep > 1 else 0))
    b = state_bytes(FULL, f.recipe_fields()["optimizer"])
    params = 0 if f.offload and f.zero_stage == 3 else sharded(b.weights, "params")
    if f.offload:
        return params, 0, 0
    grads = sharded(b.grads, "grads")
    grads += n * b.grads if f.data_ranks > 1 and f.zero_stage == 0 and f.ep == 1 else 0  # DDP buckets
    return params, grads, sharded(b.optimizer, "optimizer")


def _states_bound(counts: _Counts, f: Family) -> int:
    """Bytes per GPU of the busiest stage's model states alone: a lower bound on its peak
    (the optimizer step holds them all)."""
    return max(sum(_states(counts, f, n, e)) for n, e, *_ in counts.stages(f.tp, f.pp, f.ep))


def _bound(c, k: Candidate, counts: _Counts, seq: int, memo: dict) -> int:
    """A lower bound on a candidate's peak without ``estimate``: the model states (the optimizer
    step), or the weights and optimizer state with every saved activation (backward's start)."""
    f, L = k.family, k.layout
    v = L.chunks
    worst = 0
    for s, (n, experts, *_) in enumerate(counts.stages(f.tp, f.pp, f.ep, v, L.placement)):
        params, grads, opt = _states(counts, f, n, experts)
        acts = 0
        if f.trainable == "all":
            flight = in_flight(s, L.pp, L.micro_batch_count, L.schedule, v)
            for chunk in chunk_layers(c.layers, L.pp, v, L.placement)[s]:
                for i in chunk:
                    moe = c.is_moe and i >= c.dense_layers
                    key = (moe, f.tp, f.ep, f.cp, k.recipe.recompute, c.window_of(i))
                    if key not in memo:
                        memo[key] = layer_saved(c, FULL, moe, f.tp, k.recipe.recompute,
                                                f.tp > 1, f.ep, layer=i).bytes(1, seq // f.cp)
                    acts += memo[key] * k.micro_batch
            acts = int(acts * flight)
        worst = max(worst, params + grads + opt, params + opt + acts)
    return worst


def _candidates(c, f: Family, counts: _Counts, gpu: GPU, gpus, gpus_per_node, seq, batch,
                recomputes=RECOMPUTE):
    """Every member of a family (micro-batch x recompute x schedule) with its modelled time."""
    per_rank_batch = batch // f.dp
    lora, qlora = f.trainable != "all", f.trainable == "qlora"
    recipe_kw = dict(precision=ADAPTERS if lora else FULL, **f.recipe_fields(),
                     **fine_tuning_fields(f.trainable))
    schedules = SEARCHED_SCHEDULES if f.pp > 1 else (("1f1b", 1),)
    if lora:      # ZB-H1 and ZB-V fill their bubbles with weight-gradient work a frozen base
        schedules = tuple(s for s in schedules if s[0] not in SPLIT_BACKWARD)    # does not have
    active = counts.active
    attention = attention_forward_flops(c, seq)
    out = []
    for schedule, v in schedules:
        placement = placement_of(schedule)
        chunks = 2 if placement == "v" else v
        if f.pp * chunks > c.layers:
            continue
        stages = counts.stages(f.tp, f.pp, f.ep, chunks, placement)
        # the busiest stage for each kind of work: DeepSeek's first stage has the most layers
        # (its dense ones) but the fewest experts
        n, experts, *_, nf4 = max(stages, key=lambda s: s[0])
        layers, moe = max(s[2] for s in stages), max(s[3] for s in stages)
        frozen, frozen_bytes = 0, 2
        if lora:         # adapters only: their all-reduce is negligible; ZeRO-3 gathers the base
            n, experts, frozen = 0, 0, n
            if qlora and frozen:     # NF4 where quantised, the rest (routed experts too) bf16
                frozen_bytes = (nf4 * nf4_bits_per_param() / 8 + (frozen - nf4) * 2) / frozen
        for micro in _powers_of_two(per_rank_batch):
            m = per_rank_batch // micro
            if (per_rank_batch % micro or (schedule == "interleaved" and m % f.pp)
                    or (schedule == "zb-v" and m < 2 * f.pp)):    # its closed form's range
                continue
            layout = Layout(dp=f.dp, zero_stage=f.zero_stage, offload=f.offload, tp=f.tp,
                            sp=f.tp > 1, pp=f.pp, micro_batches=m if f.pp > 1 else None,
                            schedule=schedule, virtual_stages=v, ep=f.ep, cp=f.cp,
                            replicas=f.replicas)
            for r in recomputes:
                t = step_time(gpu, gpus=gpus, gpus_per_node=gpus_per_node, active_params=active,
                              hidden=c.hidden, top_k=c.top_k, seq=seq, global_batch=batch,
                              micro=micro, dp=f.dp, tp=f.tp, pp=f.pp, ep=f.ep, cp=f.cp,
                              kv_width=kv_width(c), attention_flops=attention,
                              zero_stage=f.zero_stage, offload=f.offload, schedule=schedule,
                              v=v, recompute=r, lora=lora, rank_params=n - experts,
                              rank_expert_params=experts, stage_layers=layers,
                              stage_moe_layers=moe, frozen_params=frozen,
                              frozen_bytes=frozen_bytes,
                              nf4_params=nf4 if qlora else 0, replicas=f.replicas)
                out.append(Candidate(f, layout, Recipe(recompute=r, **recipe_kw), micro, m, t))
    return out


# ---- the search --------------------------------------------------------------------------
def kv_width(c: ModelConfig) -> int:
    """Numbers per token in one layer's keys and values, as context parallelism moves them:
    2 x kv heads x head dim; MLA's after the up-projection (every head's key and value)."""
    if c.attention == "mla":
        return c.heads * (c.qk_nope_dim + c.qk_rope_dim + c.v_head_dim)
    return 2 * c.kv_heads * c.head_dim


def _keeps_no_less(a: Candidate, b: Candidate) -> bool:
    """Whether ``a`` keeps at least what ``b`` keeps: same family and schedule, a micro-batch
    no smaller, and the same recompute policy or ``b``'s full recomputation, which keeps the
    least (so if ``b`` fails, ``a`` fails). Selective can keep more than none: with SDPA the
    checkpointed core's inputs are what SDPA would have saved, and LoRA's copies come on top."""
    return (a.family == b.family and a.layout.schedule == b.layout.schedule
            and a.micro_batch >= b.micro_batch
            and b.recipe.recompute in (a.recipe.recompute, "full"))


def _search(c, gpu: GPU, gpus, gpus_per_node, seq, batch, usable, trainable, offload, top,
            host_usable: int | None = None, recompute=RECOMPUTE, optimizers=("adamw",)):
    """(ranked fits, rejected {family: why}, unexplored families, estimates made). An
    offloaded layout also needs its ranks' pinned host memory within ``host_usable`` per node."""
    ranks_per_node = min(gpus, gpus_per_node)
    counts = _Counts(c)
    families, pool, rejected = _pool(c, counts, gpu, gpus, gpus_per_node, seq, batch, usable,
                                     trainable, offload, recompute, optimizers)
    fits, failed, leanest = [], {}, {}      # failures by family; each family's smallest
    n_estimates, memo = 0, {}

    def fail(k, nbytes, why, bound=False):
        """Record a failure; a family's reason is its smallest estimated failure (a lower
        bound from a weaker recompute policy only when nothing was estimated)."""
        failed.setdefault(k.family, []).append(k)
        key = (bound, nbytes)
        if k.family not in leanest or key < leanest[k.family][0]:
            leanest[k.family] = (key, why)

    for k in pool:          # after ``top`` fits (none beaten in time and memory), only ties
        if _enough(fits, top, k):
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
    fits = _ranked(_undominated(fits))
    fitted = {k.family for k in fits}
    fits = fits[:top]
    members_of = {}
    for k in pool:
        members_of.setdefault(k.family, []).append(k)
    unexplored = []
    for f in families:
        if f in fitted or f.label() in rejected:
            continue
        members = members_of.get(f, [])
        if all(any(_keeps_no_less(k, bad) for bad in failed.get(f, ())) for k in members):
            rejected[f.label()] = leanest[f][1]
        else:
            unexplored.append(f.label())
    return fits, rejected, unexplored, n_estimates


def _ranked(fits: list[Candidate]) -> list[Candidate]:
    """Fastest first in groups of ties (every layout within TIE of its group's fastest); in a
    group the larger micro-batch, fewer model-parallel dimensions (tp, pp, ep, cp), AdamW
    (foreach) over 8-bit or fused AdamW (the same time), then the smaller peak."""
    fits = sorted(fits, key=lambda k: k.time.dp_overlapped)
    group, start, key = 0, None, {}
    for k in fits:
        if start is None or k.time.dp_overlapped > start * (1 + TIE):
            group, start = group + 1, k.time.dp_overlapped
        f = k.family
        key[id(k)] = (group, -k.micro_batch, sum(n > 1 for n in (f.tp, f.pp, f.ep, f.cp)),
                      f.optimizer != "adamw", k.estimate.total)
    return sorted(fits, key=lambda k: key[id(k)])


def _enough(fits: list[Candidate], top: int | None, k: Candidate) -> bool:
    """Whether the search can stop before ``k`` (the pool runs fastest first): ``top`` fits no
    other of their family beats, and ``k`` slower than the top-th of them by more than a tie."""
    if top is None or len(fits) < top:
        return False
    kept = sorted(f.time.dp_overlapped for f in _undominated(fits))
    return len(kept) >= top and k.time.dp_overlapped > kept[top - 1] * (1 + TIE)


def _undominated(fits: list[Candidate]) -> list[Candidate]:
    """The fits that no other of their family beats on both step time and memory: a slower and
    larger recompute policy, micro-batch or schedule of the same layout is no choice."""
    by_family = {}
    for k in fits:
        by_family.setdefault(k.family, []).append(k)

    def beaten(k, rivals):
        t, b = k.time.dp_overlapped, k.estimate.total
        return any(j.time.dp_overlapped <= t and j.estimate.total <= b
                   and (j.time.dp_overlapped, j.estimate.total) != (t, b) for j in rivals)
    return [k for k in fits if not beaten(k, by_family[k.family])]


def _pool(c, counts: _Counts, gpu: GPU, gpus, gpus_per_node, seq, batch, usable, trainable,
          offload, recompute=RECOMPUTE, optimizers=("adamw",)):
    """(families, their candidates fastest first, rejected {family: why}): a family is
    rejected whole when the batch does not split over its dp or its states alone overflow."""
    families, rejected = _families(c, gpus, gpus_per_node, trainable, offload, seq, optimizers)
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
    pool.sort(key=lambda k: (round(k.time.dp_overlapped, 9), -k.micro_batch))
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


def family_candidates(c: ModelConfig, gpu: GPU, gpus: int, family: Family, seq: int,
                      batch: int | None = None, gpus_per_node: int = 8,
                      recompute=RECOMPUTE, usable: int | None = None) -> list[Candidate]:
    """One family's candidates (micro-batch x recompute x schedule), fastest first, each with
    its modelled time: how the planner times a layout it may not rank. ``usable`` (bytes per
    GPU, e.g. a plan's ``usable``): only those whose estimate fits, each with its estimate;
    without it none is estimated, so a schedule that would not fit can come first."""
    out = sorted(_candidates(c, family, _Counts(c), gpu, gpus, gpus_per_node, seq,
                             batch or gpus, recompute), key=lambda k: k.time.dp_overlapped)
    if usable is None:
        return out
    for k in out:
        k.estimate = estimate(c, k.micro_batch, seq, recipe=k.recipe, layout=k.layout)
    return [k for k in out if k.estimate.total <= usable]
