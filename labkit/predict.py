"""Predict the memory of one training step, per device, as named tensors.

``estimate`` finds the peak of a steady-state step as the largest of a few moments (the loss,
the start of backward, the worst layer of the backward pass, the embedding's backward, the
optimizer step). Each moment is a list of named tensors: the model states (by the recipe's
bytes per parameter, sharded by ZeRO), what autograd saves in each layer (``labkit.layers``),
autocast's weight copies, the transient gradients and the optimizer's temporaries. The byte
rules it reads are torch-free and load no mechanism (tests/test_imports.py checks it):
``recipe`` (precisions), ``layers`` (the model), ``recompute`` (the policies),
``formats`` (NF4, 8-bit AdamW), ``parallel.zero``, ``parallel.schedules`` (pipeline stages)
and ``parallel.compose`` (expert parallelism inside data parallelism).
"""
from __future__ import annotations

from collections import defaultdict
from fractions import Fraction
from dataclasses import dataclass, field, replace

from .recompute import parse_policy, plan
from .config import ModelConfig, preset
from .layers import (SOFTMAX, ParamCount, Saved, Term, Weight, block_weights,  # noqa: F401
                     count_params, embedding_weights, head_saved, head_weights, layer_saved,
                     lora_targets, lora_weights, naive_backward_alive)
from .formats import (LOOKUP_BYTES, MAP_BYTES, eight_bit_state_bytes, nf4_bits_per_param,
                      step_temporary_bytes)
from .parallel import compose, schedules, zero
from .recipe import (STATE_NUMBERS, Layout, Recipe, compute_bytes, device_type, layout_from,
                     recipe_from, state_bytes)
from .units import CATEGORIES, HOST, Breakdown, check_positive, dtype_bytes, fmt_bytes


@dataclass(frozen=True)
class Tensor:
    """Bytes of one kind of tensor alive at a moment, with what it is."""

    name: str
    category: str
    dtype: str
    nbytes: int


@dataclass
class Estimate(Breakdown):
    """Predicted bytes per device at the step's peak. ``tensors``: what is alive then, by name;
    ``moments``: every candidate moment's total (the peak is the largest)."""

    moments: dict = field(default_factory=dict)
    tensors: list = field(default_factory=list)

    def explain(self) -> str:
        """The tensors alive at the peak, largest first, one per line; then what the estimate
        assumes (``details["assumes"]``)."""
        rows = sorted(self.tensors, key=lambda t: -t.nbytes)
        width = max(len(t.name) for t in rows)
        lines = [f"{t.name:<{width}}  {CATEGORIES.get(t.category, 'host memory'):<22} {t.dtype:<11}"
                 f"{fmt_bytes(t.nbytes):>12}" for t in rows if t.nbytes]
        return "\n".join(lines + [f"assumes: {a}" for a in self.details.get("assumes", [])])


def estimate(cfg: ModelConfig | str, batch: int = 1, seq: int = 2048,
             precision: str = "bf16-mixed", optimizer: str = "adamw", recompute: str = "none",
             zero_stage: int = 0, dp: int = 1, tp: int = 1, pp: int = 1, sp: bool = False,
             optimizer_impl: str | None = None, device="cuda", every: int = 2,
             loss_chunk: int | None = None, attention: str = "sdpa", trainable: str = "all",
             lora_rank: int = 16, weight_format: str | None = None,
             recipe: Recipe | None = None, layout: Layout | None = None) -> Estimate:
    """Predicted peak bytes per device of one steady-state training step, by category.

    The arguments are ``measure_step``'s. Give the step as keywords or as
    ``recipe=lk.Recipe(...)``, and the layout as keywords or as ``layout=lk.Layout(...)``:
    a keyword the recipe or layout contradicts raises. ``device`` ("cuda", "cuda:0", a
    torch.device): whose defaults (AdamW is foreach on "cuda", a for-loop on "cpu"); a real GPU
    adds its CUDA context, allocator rounding and library workspaces.
    With ``pp`` > 1 the device reported is the busiest stage. ``loss_chunk``: tokens per chunk
    of a chunked loss (``labkit.loss``), None for the full logits. ``attention``: the core
    (``labkit.attention``: "sdpa", "naive" or "tiled"). With ``ep`` > 1 the device is
    one of the dp ranks under balanced routing (``labkit.parallel.compose``); a skewed router
    loads one rank more (``labkit.parallel.expert.routing_imbalance`` measures it).
    ``zero_stage=3`` models labkit's ZeroOptimizer (one unit gathered at a time) for full
    fine-tuning, and FSDP2 (its backward prefetch and held all-gather outputs) under LoRA, the
    only way LoRA shards its base; FSDP2 holds up to ~4% more than the first (lab 09 checks).
    """
    c = preset(cfg) if isinstance(cfg, str) else cfg
    recipe = recipe_from(recipe, precision=precision, optimizer=optimizer,
                         optimizer_impl=optimizer_impl, recompute=recompute, every=every,
                         loss_chunk=loss_chunk, attention=attention, trainable=trainable,
                         lora_rank=lora_rank, weight_format=weight_format)
    layout = layout_from(layout, dp=dp, zero_stage=zero_stage, tp=tp, sp=sp, pp=pp)
    batch, seq = check_positive("batch", batch), check_positive("seq", seq)
    device = device_type(device)
    layout.check(c, seq)
    stages = [sorted(i for chunk in chunks for i in chunk)              # interleaved: v chunks
              for chunks in schedules.chunk_layers(c.layers, layout.pp, layout.virtual_stages)]
    per_stage = [_Step(c, batch, seq, recipe, layout, device, s, layers).estimate()
                 for s, layers in enumerate(stages)]
    busiest = max(per_stage, key=lambda e: e.total)
    if layout.pp > 1:        # each stage's peak and what it keeps for the backward pass
        busiest.details["stages"] = [dict(total=e.total, saved_activations=e.saved_activations,
                                          peak_moment=e.details["peak moment"])
                                     for e in per_stage]
    return busiest


# the moments of the backward pass before it reaches the last block
HEAD_BACKWARD = ("backward: start", "backward: loss", "backward: LM head", "backward: final norm")


def _check_lora_layout(recipe: Recipe, layout: Layout) -> None:
    """LoRA and QLoRA are estimated over data parallelism: replicas (DDP over the adapters,
    zero_stage=0), or LoRA's frozen base sharded by FSDP2 (zero_stage=3)."""
    others = {"tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "cp": layout.cp}
    split = {k: v for k, v in others.items() if v > 1}
    if split or layout.offload:
        given = ", ".join(f"{k}={v}" for k, v in split.items()) or "offload=True"
        raise ValueError(f"trainable='lora' is estimated over data parallelism (dp with ZeRO-0 "
                         f"or ZeRO-3) so far, not with {given}: use Layout(dp=..., zero_stage=0 "
                         f"or 3)")
    if layout.zero_stage in (1, 2) and layout.dp > 1:
        raise ValueError(f"trainable='lora' with zero_stage={layout.zero_stage} is not estimated: "
                         f"ZeRO-1/2 keep the frozen base whole on every rank, as replicas do; "
                         f"use zero_stage=0, an upper bound by the adapters' gradients and "
                         f"optimizer states (1-3% of a LoRA step)")
    if recipe.weight_format == "nf4" and layout.zero_stage == 3 and layout.dp > 1:
        raise ValueError("QLoRA under ZeRO-3 (FSDP-QLoRA) is not estimated yet: FSDP2 shards an "
                         "NF4 base through torchao's NF4Tensor or bitsandbytes' quant_storage, "
                         "neither modelled here; use zero_stage=0 (replicas), or LoRA "
                         "(weight_format=None) with ZeRO-3")


class _Step:
    """One pipeline stage's step: its model states, its saved tensors, its moments."""

    def __init__(self, c, batch, seq, recipe, layout, device, stage, layers):
        self.c, self.recipe, self.L = c, recipe, layout
        self.B, self.T = batch, seq // layout.cp                 # tokens on this rank
        self.N = self.B * self.T
        self._names: dict = {}        # id(Saved) -> (it, its bytes by name): see _by_name
        self.layers = list(layers)
        self.stage, self.first, self.last = stage, stage == 0, stage == layout.pp - 1
        self.in_flight = schedules.in_flight(stage, layout.pp, layout.micro_batch_count,
                                            layout.schedule, layout.virtual_stages)
        # AdamW's implementation: the device's default; offloaded, the step runs on the host,
        # where torch's default is the for-loop
        self.impl = recipe.impl("cpu" if layout.offload else device)
        self.bytes = state_bytes(recipe.precision, recipe.optimizer)
        self.mixed = self.bytes.weight_cache > 0                          # autocast
        self.wdt = "fp32" if self.bytes.weights == 4 else "bf16"          # weights, grads, stream
        self.cdt = "fp32" if recipe.precision == "fp32" else "bf16"       # what matmuls produce
        self.master = recipe.precision.endswith("-master")
        self.eight_bit = recipe.optimizer == "adamw-8bit"                   # labkit's AdamW8bit
        tp, ep = layout.tp, layout.ep
        self.moe = [i >= c.dense_layers for i in self.layers]
        self.block_params = [sum(w.local(tp, ep) for w in block_weights(c, m)) for m in self.moe]
        self.weights: list[Weight] = ((embedding_weights(c) if self.first else [])   # model order
                                      + [w for m in self.moe for w in block_weights(c, m)]
                                      + (head_weights(c) if self.last else []))
        self.n_local = sum(w.local(tp, ep) for w in self.weights)
        # what trains: every weight, or LoRA's adapters on the frozen model (``labkit.lora``)
        self.lora = recipe.trainable == "lora"
        if self.lora:
            _check_lora_layout(recipe, layout)
        self.lora_rank = recipe.lora_rank if self.lora else 0
        self.trained = ([w for m in self.moe for w in lora_weights(c, m, self.lora_rank)]
                        if self.lora else self.weights)
        self.n_train = sum(w.local(tp, ep) for w in self.trained)
        self.block_trained = ([sum(w.local() for w in lora_weights(c, m, self.lora_rank))
                               for m in self.moe] if self.lora else self.block_params)
        # ZeRO over dp > 1 ranks works on flat units (``parallel.zero.units``): the rest of the
        # model (embedding, final norm, LM head), then each block; stage 1: the whole model
        self.zero = layout.zero_stage if layout.dp > 1 or layout.offload else 0
        self.offload = layout.offload           # ZeRO's shards (from stage 3 params too) on the host
        rest = (embedding_weights(c) if self.first else []) + (head_weights(c) if self.last else [])
        rest_params = sum(w.local(tp, ep) for w in rest)
        # what ZeRO steps and reduces is what trains: LoRA's adapters, each block's in its unit
        # (the root unit - embedding, final norm, LM head - is frozen); stage 3 (FSDP) gathers
        # every parameter of a unit, LoRA's frozen base too
        self.units = zero.units(self.block_trained, 0 if self.lora else rest_params, self.zero)
        self.unit_ranks = [layout.dp] * len(self.units)   # the ranks each unit is sharded over
        # with ep, ZeRO-1 shards the replicated weights over every dp rank and this rank's
        # experts over their dp / ep copies (``parallel.zero_step``'s experts, Megatron's
        # distributed optimizer): two units
        routed = sum(w.local(tp, ep) for w in self.trained if w.copies > 1) if ep > 1 else 0
        if self.zero and routed:
            self.units, self.unit_ranks = ([self.units[0] - routed, routed],
                                           [layout.dp, layout.dp // ep])
        self.rest = rest_params if self.zero >= 2 and rest and not self.lora else 0
        self.gathered_blocks = ([p + t for p, t in zip(self.block_params, self.block_trained)]
                                if self.lora else self.block_params)
        self.gathered_rest = rest_params if self.zero == 3 else 0
        self.fsdp2 = self.lora and self.zero == 3   # LoRA's ZeRO-3 is FSDP2's: its buffers count
        # gloo (CPU) stages a copy of every buffer it sends; NCCL works in place
        self.staged = device == "cpu"
        # DDP (dp > 1 without ZeRO) keeps flat gradient buckets for the whole run; with
        # gradient_as_bucket_view the gradients are views of them instead of a second copy
        # (labkit's expert-parallel step averages in place instead: ``Layout.ddp_buckets``)
        self.ddp = layout.dp > 1 and layout.zero_stage == 0 and layout.keeps_ddp_buckets
        self.in_buckets = self.ddp and layout.gradient_as_bucket_view

    # ---- model states ------------------------------------------------------------------------
    def states(self) -> list[Tensor]:
        c, L, b, n = self.c, self.L, self.bytes, self.n_train
        wdt = self.wdt
        numbers = STATE_NUMBERS[self.recipe.optimizer]
        moments = self._per_rank(b.optimizer - (4 if self.master else 0), "optimizer")
        if self.eight_bit:          # per stepped tensor: codes + fp32 block absmax, or fp32
            moments = sum(eight_bit_state_bytes(size) for size in self._stepped_sizes())
        state = HOST if self.offload else "optimizer"
        # offloaded, the shard AdamW steps lives on the host (fp32 master, or the weights');
        # at stage 3 it is the only copy of the parameters between gathers
        on_device = 0 if self.offload and self.zero == 3 else 1
        out = [Tensor("LoRA adapters A and B" if self.lora else "weights", "params", wdt,
                      on_device * self._per_rank(b.weights, "params")),
               *self._frozen_weights(),
               Tensor(f"{self.recipe.optimizer} state ({numbers} numbers per parameter)",
                      state, "int8" if self.recipe.optimizer == "adamw-8bit" else
                      ("fp32" if self.master else wdt), moments),
               Tensor("RoPE cos and sin tables", "other", "fp32", 2 * c.max_seq * c.rope_dim * 4)]
        if self.eight_bit:
            out += [Tensor("8-bit maps (2 x 256 values)", state, "fp32", MAP_BYTES),
                    Tensor("8-bit maps' lookup tables", "other", "fp32", LOOKUP_BYTES)]
        if self.master or self.offload:
            out.append(Tensor("fp32 master weights" if self.master else "weights' shard",
                              state, "fp32" if self.master else wdt,
                              self._per_rank(4 if self.master else b.weights, "optimizer")))
        if self.ddp:
            out.append(Tensor("DDP gradient buckets", "grads", wdt, n * self.bytes.grads))
        if self.recipe.optimizer == "adamw":   # on CUDA torch keeps them on the host
            out.append(Tensor("AdamW step counters", state, "fp32",   # unless fused: the
                              4 * (len(self.units) if self.zero else len(self.trained))))
        return out

    def _per_rank(self, number: int, state: str) -> int:
        """Bytes one rank holds of a ``state`` of ``number`` bytes per trained parameter: all of
        them, or from the stage that shards it the rank's share of each unit."""
        if len(set(self.unit_ranks)) == 1:
            return zero.per_rank(self.n_train * number, state, self.L.zero_stage, self.L.dp)
        if self.L.zero_stage < zero.SHARDED_FROM_STAGE[state]:
            return self.n_train * number
        return sum(zero.shard(n, r) for n, r in zip(self.units, self.unit_ranks)) * number

    def _frozen_weights(self) -> list[Tensor]:
        """LoRA's frozen model: the targeted linears in ``weight_format`` (NF4: packed codes and
        double-quantised scales, ``quant.nf4_bits_per_param``, plus one fp32 mean of the scales
        per tensor), everything else (embedding, norms, router, routed experts, LM head) in the
        precision's dtype. No gradients, no optimizer state."""
        if not self.lora:
            return []
        targets = [w for m in self.moe for w in lora_targets(self.c, m)]
        numel = sum(w.numel for w in targets)
        rest = (self.n_local - numel) * self.bytes.weights
        if self.zero == 3:         # FSDP shards the frozen base too (QLoRA's is refused above)
            return [Tensor("frozen weights' shard", "params", self.wdt,
                           zero.per_rank(numel * self.bytes.weights + rest, "params", 3,
                                         self.L.dp))]
        if self.recipe.weight_format == "nf4":
            stored = sum(round(w.numel * nf4_bits_per_param() / 8) + 4 for w in targets)
            return [Tensor("frozen linears of the blocks (NF4 codes and scales)", "params",
                           "nf4", stored),
                    Tensor("frozen embedding, norms, LM head (not quantised)", "params",
                           self.wdt, rest)]
        return [Tensor("frozen weights", "params", self.wdt, numel * self.bytes.weights + rest)]

    def grads(self) -> int:
        return self._done(self.n_train * self.bytes.grads)

    def _done(self, grad_bytes: int) -> int:
        """What a rank keeps of finished gradients apart from DDP's buckets (nothing when the
        gradients are views of them)."""
        if self.in_buckets:
            return 0
        return zero.per_rank(grad_bytes, "grads", self.L.zero_stage, self.L.dp)

    # ---- activations ---------------------------------------------------------------------------
    def saved_per_layer(self) -> tuple[list[Saved], list[Saved], dict[int, int]]:
        """(what each layer keeps under the policy, what it keeps without one, unit starts)."""
        c, p, L = self.c, self.recipe.precision, self.L
        name, _ = parse_policy(self.recipe.recompute, self.recipe.every)
        units = plan(len(self.layers), self.recipe.recompute, self.recipe.every)
        kept = {}            # what each layer keeps: everything, its input, or (inside a unit) nothing
        for u in units:
            kept[u.first] = "selective" if name == "selective" else ("full" if u.recompute else "none")
            kept.update({i: "nothing" for i in range(u.first + 1, u.last)})
        lora = [dict(lora_rank=self.lora_rank, first=self.first and j == 0,
                     weight_format=self.recipe.weight_format) if self.lora else {}
                for j in range(len(self.moe))]
        full = [self._with_permutations(layer_saved(c, p, m, L.tp, "none", L.sp, L.ep, **lora[j],
                                                    attention=self.recipe.attention), m)
                for j, m in enumerate(self.moe)]
        saved = [Saved() if kept[j] == "nothing" else full[j] if kept[j] == "none" else
                 layer_saved(c, p, m, L.tp, kept[j], L.sp, L.ep, **lora[j])
                 for j, m in enumerate(self.moe)]
        self.kept = kept
        return saved, full, {i: u.first for u in units for i in range(u.first, u.last)}

    def _with_permutations(self, saved: Saved, moe: bool) -> Saved:
        """Under expert parallelism an MoE layer also keeps the two int64 permutations that
        regroup the rows its experts received by expert and back (top_k rows per token)."""
        if not (moe and self.L.ep > 1):
            return saved
        return Saved(saved + [Term("expert-parallel permutations (argsort and its inverse)",
                                   "int64", compose.permutation_bytes(self.c.top_k))])

    def tensors_of(self, layers: list[Saved], times: int = 1, label: str = "") -> list[Tensor]:
        """The terms of several layers' ``Saved``, added up by name (x ``times`` micro-batches)."""
        total, meta = defaultdict(int), {}
        for saved in layers:
            for name, (term, nbytes) in self._by_name(saved).items():
                total[name] += nbytes
                meta[name] = term
        suffix = f", {label}" if label else ""
        if getattr(times, "denominator", 1) == 1:    # a whole number (int arithmetic is faster)
            times = int(times)
        return [Tensor(k + suffix, meta[k].category, meta[k].dtype, int(v * times))
                for k, v in total.items()]

    def _by_name(self, saved: Saved) -> dict:
        """{name: (its last term, the bytes of its terms)} of one layer's ``Saved``, worked out
        once per step (the moments add up the same layers many times over)."""
        key = id(saved)
        if key not in self._names:            # the Saved is kept with it: its id stays its own
            by_name = {}
            for term in saved:
                by_name[term.name] = (term, by_name.get(term.name, (None, 0))[1]
                                      + term.bytes(self.B, self.T))
            self._names[key] = (saved, by_name)
        return self._names[key][1]

    def _head(self, heads) -> list[Tensor]:
        """What the last stage's final norm, LM head and loss keep, for ``heads`` micro-batches."""
        return self.tensors_of([head_saved(self.c, self.recipe.precision, self.L.tp,
                                           self.recipe.loss_chunk, self.L.sp, frozen=self.lora)],
                               heads)

    def _sent_outputs(self, flight=None) -> list[Tensor]:
        """A pipeline stage keeps each (B, T, hidden) output it sent until that micro-batch's
        backward, as torch.distributed.pipelining and labkit's executor do (Megatron-LM frees
        the data once sent): one per chunk in flight, but the model's last."""
        if self.L.pp == 1:
            return []
        v = self.L.virtual_stages
        chunks = (self.in_flight if flight is None else flight) * (v if not self.last else v - 1)
        return [Tensor("stage outputs sent, kept until their backward", "activations",
                       self.wdt, int(self.N * self.c.hidden * self.bytes.weights * chunks))]

    # ---- the moments -----------------------------------------------------------------------
    def estimate(self) -> Estimate:
        """The largest of the step's moments, each a list of the tensors alive then."""
        saved, full, unit_start = self.saved_per_layer()
        flight = self.in_flight
        label = f"{len(self.layers)} layers" + (f" x {float(flight):g} micro-batches"
                                                if flight > 1 else "")
        kept = self.tensors_of(saved, flight, label) + self._sent_outputs()
        always = self.states()
        if self.first:       # alive the whole step: inputs and shifted targets, (B, T + 1) int64
            always.append(Tensor("token batch", "activations", "int64", 8 * self.B * (self.T + 1)))
        if self.last:
            always.append(Tensor("loss", "activations", "fp32", 4))
        # GPipe's last stage runs every micro-batch's loss before any backward: it keeps m heads
        heads = flight if self.L.schedule == "gpipe" else 1
        head = self._head(heads) if self.last else []
        moments = {**(self._loss_moments(always + kept, head) if self.last else {}),
                   **(self._final_norm_moment(always + kept) if self.last else {}),
                   **self._worst_layer_moment(always, saved, full, unit_start),
                   **self._naive_attention_moment(always, saved, full, unit_start),
                   **self._later_micro_batch_moments(always, saved, label),
                   **(self._embedding_moment(always) if self.first else {}),
                   **self._optimizer_moment(always),
                   **self._lora_recompute_moment(always, saved, full, unit_start),
                   **self._dequantise_moment(always, saved, full, unit_start)}
        if self.zero == 3:
            moments.update(self._gather_moments(always, saved, kept + head))
            for name, (phase, tensors) in moments.items():   # the root stays gathered throughout
                if phase != "optimizer":
                    tensors.append(self._gathered("the embedding, final norm and LM head",
                                                  self.gathered_rest))
                if name.startswith(HEAD_BACKWARD):  # the last block's gather is under way
                    tensors += self._prefetched(len(self.layers))
        return self._result(moments, saved=always + kept + head)

    def _loss_moments(self, kept: list[Tensor], head: list[Tensor]) -> dict:
        """The forward pass at the loss (logits and log-softmax side by side) and the start of
        backward (the log-softmax's and the logits' gradients), both (N, V) fp32."""
        c, tp, alive = self.c, self.L.tp, kept + head
        # autocast caches each weight's bf16 copy until the forward pass ends; a recomputed
        # layer saves none of them, so for it the cache is extra. Under LoRA nothing is cached:
        # autocast caches leaf weights that train, and the adapters reach their matmuls as A^T
        cache = sum(2 * sum(w.local(tp, self.L.ep) for w in block_weights(c, m) if w.matmul)
                    for j, m in enumerate(self.moe)
                    if self.kept[j] != "none") if (self.mixed and not self.lora
                                                   and self.recipe.autocast_cache) else 0
        cache = Tensor("autocast cache of recomputed layers' weights", "weight_cache", "bf16", cache)
        if self.recipe.loss_chunk:
            return self._chunked_loss_moments(kept, head, cache)
        if tp > 1:
            return self._vocab_parallel_loss_moments(alive, cache)
        logits = self.N * c.vocab_size // tp * 4
        at_loss = [Tensor("logits", "activations", "fp32", logits),
                   Tensor("bf16 logits", "activations", "bf16", logits // 2 if self.mixed else 0),
                   cache]
        start = [Tensor("log-softmax gradient and logits gradient", "other", "fp32", 2 * logits)]
        return {"forward: loss": ("forward", alive + at_loss),
                "backward: start": ("backward", alive + start)}

    def _vocab_parallel_loss_moments(self, alive: list[Tensor], cache: Tensor) -> dict:
        """Megatron's vocabulary-parallel loss (``parallel.tensor``) works in place: a rank's
        fp32 (N, V/tp) logits become the softmax it saves (``head_saved``), then the logits'
        gradient. 16-bit logits are copied to fp32 first and stay alive until the loss is
        taken; the gradient is cast back to 16 bits, which frees the fp32 one. Then the LM
        head's backward forms its weight's gradient and its input's; under sp it all-gathers
        its input again and reduce-scatters the input's gradient to this rank's tokens."""
        c, tp, sp, cb = self.c, self.L.tp, self.L.sp, (4 if self.cdt == "fp32" else 2)
        wide = self.N * c.hidden * cb                                          # (N, hidden)
        logits = self.N * c.vocab_size // tp                                   # (N, V/tp)
        sixteen = Tensor("16-bit logits (gradient)", "other", self.cdt,
                         logits * 2 if cb == 2 else 0)
        # with 16-bit matmuls this micro-batch's fp32 softmax is gone once cast to 16 bits
        softmax_freed = [replace(t, nbytes=t.nbytes - logits * 4)
                         if cb == 2 and t.name == SOFTMAX else t for t in alive]
        head = [sixteen,
                Tensor("LM head gradient being formed", "other", self.cdt,
                       c.vocab_size // tp * c.hidden * cb),
                Tensor("gradient of the LM head's input", "other", self.cdt, wide),
                Tensor("LM head's input, all-gathered again (sp)", "other", self.cdt,
                       wide if sp else 0),
                Tensor("this rank's tokens of its gradient (sp)", "other", self.cdt,
                       wide // tp if sp else 0)]
        return {"forward: loss": ("forward", alive + [sixteen, cache]),
                "backward: loss": ("backward", alive + [sixteen]),
                "backward: LM head": ("backward", softmax_freed + head)}

    def _chunked_loss_moments(self, kept: list[Tensor], head: list[Tensor], cache: Tensor) -> dict:
        """A chunked loss (``labkit.loss``) holds one chunk's fp32 logits (and their bf16
        original when the matmuls run in bf16) in the forward pass, and again in the backward
        pass beside the LM head's gradients being formed. Under autocast those are bf16, and
        their fp32 copies are made after the loss has freed what it saved. LoRA: the frozen LM
        head forms no gradient."""
        c, tp, cb, alive = self.c, self.L.tp, 4 if self.cdt == "fp32" else 2, kept + head
        rows = min(self.recipe.loss_chunk, self.N)
        chunk = rows * c.vocab_size // tp * (4 if cb == 4 else 6)    # (rows, V) fp32 (+ bf16)
        dtype = "fp32" if cb == 4 else "fp32 + bf16"
        head_numel = 0 if self.lora else c.vocab_size * c.hidden // tp
        forming = [Tensor("gradient of the LM head's input", "other", self.cdt, self.N * c.hidden * cb),
                   Tensor("LM head gradient being formed", "other", self.cdt, head_numel * cb)]
        moments = {
            "forward: loss": ("forward", alive + [
                Tensor(f"logits of one chunk of {rows} tokens", "activations", dtype, chunk), cache]),
            "backward: loss chunks": ("backward", alive + forming + [
                Tensor(f"logits gradient of one chunk of {rows} tokens", "other", dtype, chunk)])}
        if self.mixed:
            norm = [t for t in head if t.name == "final RMSNorm"]      # all the head still keeps
            moments["backward: LM head gradient to fp32"] = ("backward", kept + norm + forming + [
                Tensor("LM head gradient, fp32", "grads", "fp32", head_numel * 4)])
        return moments

    def _final_norm_moment(self, alive: list[Tensor]) -> dict:
        """The final RMSNorm's backward, after the loss's: every layer's saved tensors, the
        norm's fp32 input and five fp32 (N, hidden) temporaries of its backward (the gradients
        through x^2, its mean and rsqrt), with the LM head's gradients done."""
        c, split = self.c, (self.L.tp if self.L.sp else 1)
        fp32_wide = self.N * c.hidden * 4 // split                               # (N, hidden) fp32
        done = (0 if self.lora else
                sum(w.local(self.L.tp) for w in head_weights(c)) * self.bytes.weights)
        return {"backward: final norm": ("backward", alive + [
            Tensor("final RMSNorm's input", "activations", "fp32", fp32_wide),
            Tensor("final RMSNorm's backward temporaries", "other", "fp32", 5 * fp32_wide),
            *(self._grads_in_backward([]) if self.zero else
              [Tensor("gradients of the LM head and final norm", "grads", self.wdt,
                      self._done(done))])])}

    def _worst_layer_moment(self, always, saved, full, unit_start) -> dict:
        """Inside each layer's backward (last layer first): what the layers below still keep,
        the gradients done so far, the layer's transients and what recomputation rebuilt."""
        c, stream, flight = self.c, self.bytes.weights, self.in_flight
        head_grads = (sum(w.local(self.L.tp) for w in head_weights(c)) * stream
                      if self.last and not self.lora else 0)
        worst, worst_reduce = None, None
        for i in reversed(range(len(self.layers))):
            grads = (self._grads_in_backward(range(i + 1, len(self.layers))) if self.zero else
                     [Tensor("gradients of the layers done", "grads", self.wdt,
                             self._done(sum(self.block_trained[i + 1:]) * stream + head_grads))])
            this_block = ([self._bucket("this block", self.block_trained[i])] if self.zero >= 2
                          else []) + ([self._gathered("this block", self.gathered_blocks[i])]
                                      if self.zero == 3 else []) + self._prefetched(i)
            tensors = always + self._kept_up_to(saved, i) + grads + this_block + [
                Tensor("first gradient of this layer (MLP down projection)", "grads", self.wdt,
                       self._first_grad(self.moe[i])),
                Tensor("activation gradients in flight", "other", self.cdt,
                       self._layer_backward_transient(self.moe[i]) + self.N * c.hidden * stream),
                self._recomputed(i, saved, full, unit_start)]
            if worst is None or _total(tensors) > _total(worst[1]):
                worst = (i, tensors)
            if self.zero >= 2:         # the block's backward is done: its bucket reduce-scattered
                reduce = always + self._kept_up_to(saved, i - 1) + grads + this_block + [
                    self._reduced_shard(self.block_trained[i]),
                    self._staging(self.block_trained[i], self.bytes.grads),
                    Tensor("gradient of the residual stream", "other", self.wdt,
                           self.N * c.hidden * stream)]
                if worst_reduce is None or _total(reduce) > _total(worst_reduce[1]):
                    worst_reduce = (i, reduce)
        out = {f"backward: layer {self.layers[worst[0]]}": ("backward", worst[1])}
        if worst_reduce:
            out[f"backward: reduce-scatter of layer {self.layers[worst_reduce[0]]}"] = (
                "backward", worst_reduce[1])
        return out

    def _recomputed(self, i: int, saved, full, unit_start) -> Tensor:
        """What recomputation has rebuilt by layer i's backward: the layers of its unit from the
        unit's first to i, less what they keep anyway (the unit's input: the first norm's fp32
        input itself when the stream is fp32)."""
        a, B, T = unit_start[i], self.B, self.T
        rebuilt = (sum(f.bytes(B, T) for f in full[a:i + 1])
                   - sum(s.bytes(B, T) for s in saved[a:i + 1]))
        return Tensor("recomputed activations", "other", self.cdt, rebuilt)

    def _naive_attention_moment(self, always, saved, full, unit_start) -> dict:
        """Naive attention's backward in each layer (``layers.naive_backward_alive``): the
        layers below keep their tensors (those recomputed with it rebuilt), this layer's MLP,
        output projection and norm have their gradients, and two (B, H, T, T) gradients form."""
        if self.recipe.attention != "naive" or self.lora:
            return {}
        c, B, T, L, stream = self.c, self.B, self.T, self.L, self.bytes.weights
        alive = naive_backward_alive(c, self.recipe.precision, L.tp, L.sp)
        head_grads = sum(w.local(L.tp) for w in head_weights(c)) * stream if self.last else 0
        worst = None
        # a recomputed unit's input, held by its checkpoint, is the first norm's fp32 input
        # itself when the stream is fp32; in bf16 that norm keeps an fp32 copy beside it
        shared = stream == 4
        for i in reversed(range(len(self.layers))):
            a = unit_start[i]
            rebuilt = (sum(f.bytes(B, T) for f in full[a:i])
                       - (sum(s.bytes(B, T) for s in saved[a:i]) if shared else 0)
                       + (saved[i].bytes(B, T) if self.kept[i] == "full" and not shared else 0))
            done = [w for w in block_weights(c, self.moe[i])
                    if not w.name.startswith(("attn_norm", "attn.")) or w.name == "attn.wo"]
            grads = (self._grads_in_backward(range(i + 1, len(self.layers))) if self.zero else
                     [Tensor("gradients of the layers done", "grads", self.wdt,
                             self._done(head_grads + stream * (sum(self.block_trained[i + 1:])
                                        + sum(w.local(L.tp, L.ep) for w in done))))])
            tensors = always + self._kept_up_to(saved, i - 1) + grads + self.tensors_of(
                [alive], label=f"layer {self.layers[i]} in its attention's backward") + [
                Tensor("gradient of the residual stream", "other", self.wdt,
                       self.N * c.hidden * stream),
                Tensor("recomputed activations", "other", self.cdt, rebuilt)]
            if worst is None or _total(tensors) > _total(worst[1]):
                worst = (i, tensors)
        return {f"backward: naive attention of layer {self.layers[worst[0]]}": ("backward",
                                                                                 worst[1])}

    def _kept_up_to(self, saved, i: int, flight=None) -> list[Tensor]:
        """What layers 0..i keep for the backward pass (and, in a pipeline, every layer of the
        other micro-batches in flight: ``flight`` in all, by default the most the stage holds)."""
        flight = self.in_flight if flight is None else flight
        return self.tensors_of(saved[:i + 1], flight, f"layers up to {i}") + (
            self.tensors_of(saved[i + 1:], flight - 1, "other micro-batches in flight")
            if flight > 1 else []) + self._sent_outputs(flight)

    def _later_micro_batch_moments(self, always, saved, label: str) -> dict:
        """With m > 1 micro-batches (a pipeline, or accumulation) every backward after the first
        runs with all of the stage's gradients formed by the earlier ones: in 1F1B's steady state
        with as many micro-batches in flight as its warm-up left (GPipe: one fewer). The last
        stage's loss, and each layer's backward, then add their transients (new gradients are
        accumulated in place). Measured per stage (benchmarks/pipeline_schedules.py): within 3%
        for every schedule once m > p; at m = p, where no stage reaches a steady state, ZB-H1's
        and interleaved 1F1B's estimates run up to 10% high."""
        m, flight = self.L.micro_batch_count, self.in_flight
        # interleaved with every forward first (m <= its warm-up): a chunk's gradients are all
        # formed only once the stage's last chunk has run its backward, by then mostly freed
        if m == 1 or self.zero or (self.L.virtual_stages > 1 and flight == m):
            return {}
        later = flight if flight < m else flight - 1
        grads = Tensor("gradients of every layer of the stage (earlier micro-batches)", "grads",
                       self.wdt, self.grads())
        out = {}
        if self.last:
            kept = self.tensors_of(saved, later, label) + self._sent_outputs(later)
            heads = later if self.L.schedule == "gpipe" else 1
            head = self._head(heads)
            out = {f"{name}, a later micro-batch": moment for name, moment in
                   self._loss_moments(always + kept + [grads], head).items()}
            if self.L.tp == 1 and not self.recipe.loss_chunk:   # (vocab-parallel: its own)
                logits, wide = self.N * self.c.vocab_size, self.N * self.c.hidden
                # this micro-batch's log-softmax is used up; GPipe's other heads keep theirs
                saved_head = [replace(t, nbytes=int(t.nbytes * (heads - 1) / heads))
                              if t.name.startswith("log-softmax") else t for t in head]
                alive = always + kept + saved_head
                out["backward: LM head, a later micro-batch"] = ("backward", alive + [
                    grads, Tensor("logits gradient", "other", "fp32", 4 * logits),
                    Tensor("the LM head's new gradient, before it is added", "other", self.wdt,
                           self.c.vocab_size * self.c.hidden * self.bytes.weights),
                    Tensor("gradient of the LM head's input", "other", self.cdt,
                           wide * compute_bytes(self.recipe.precision))])
        if self.first:       # the embedding's backward forms a whole new (V, h) gradient
            others = later - Fraction(1, self.L.virtual_stages)     # this one's chunk 0 is done
            out["backward: embedding, a later micro-batch"] = ("backward", always + (
                self.tensors_of(saved, others, "other micro-batches in flight")
                if others > 0 else []) + self._sent_outputs(later) + [grads,
                Tensor("the embedding's new gradient, before it is added", "other", self.wdt,
                       self.c.vocab_size * self.c.hidden * self.bytes.weights // self.L.tp),
                Tensor("gradient of the residual stream", "other", self.wdt,
                       self.N * self.c.hidden * self.bytes.weights)])
        worst = None
        for i in reversed(range(len(self.layers))):
            tensors = always + self._kept_up_to(saved, i, later) + [grads,
                Tensor("this layer's new gradient, before it is added", "other", self.wdt,
                       self._first_grad(self.moe[i])),
                Tensor("activation gradients in flight", "other", self.cdt,
                       self._layer_backward_transient(self.moe[i])
                       + self.N * self.c.hidden * self.bytes.weights)]
            if worst is None or _total(tensors) > _total(worst[1]):
                worst = (i, tensors)
        out[f"backward: layer {self.layers[worst[0]]}, a later micro-batch"] = ("backward",
                                                                                worst[1])
        if self.L.schedule == "zb-h1":
            # the deferred W's micro-batches are among those in flight: all of them at a W
            out.update(self._weight_gradient_moment(always, saved, label, grads, flight))
        return out

    def _weight_gradient_moment(self, always, saved, label: str, grads: Tensor, flight) -> dict:
        """ZB-H1's W of a later micro-batch: a split backward (B) leaves the gradient of each
        weight's output until W forms the weights' gradients from it, and keeps the micro-batch's
        saved tensors (the graph) until then. Stage s defers s W's: s + 1 micro-batches' output
        gradients alive at a W, beside the ``flight`` micro-batches in flight, whole."""
        c, tp = self.c, self.L.tp
        width = {True: 0, False: 0}                 # per token: matmul outputs, other outputs
        for w in self.weights:
            width[w.matmul] += w.out_width(tp)
        per_micro_batch = self.N * (width[True] * compute_bytes(self.recipe.precision)
                                    + width[False] * self.bytes.weights)
        pending = min(self.stage + 1, self.L.micro_batch_count)
        largest = max(w.local(tp, self.L.ep) for w in self.weights) * self.bytes.grads
        kept = self.tensors_of(saved, flight, label) + self._sent_outputs(flight)
        name = "backward: weight gradients (W), a later micro-batch"
        return {name: ("backward", always + kept + [
            grads,
            Tensor(f"output gradients kept for W ({pending} micro-batches)", "other", self.cdt,
                   pending * per_micro_batch),
            Tensor("a weight's new gradient, before it is added", "other", self.wdt, largest)])}

    # ---- LoRA and QLoRA: the forward run again inside the backward, NF4's dequantisation --------
    def _lora_recompute_moment(self, always, saved, full, unit_start) -> dict:
        """A recomputed LoRA layer peaks in its forward run again, at its MLP's widest adapted
        linear (w_up): the base output, the update, the scaled update and their sum stand where
        up and the product will (as much as the MLP's backward transients), and the down
        projection has made nothing yet: no x A^T, no autocast copies of its frozen weight and
        adapters (``_forward_again``)."""
        if not self.lora:
            return {}
        N, h, r, cb, worst = self.N, self.c.hidden, self.lora_rank, compute_bytes(
            self.recipe.precision), None
        for i in reversed(range(len(self.layers))):
            if self.kept[unit_start[i]] == "none":
                continue
            width = self._mlp_width(self.moe[i])
            frozen = width * h if self.recipe.weight_format is None else 0     # NF4: no copy
            down = N * r * cb + (2 * (frozen + r * (width + h)) if self.mixed else 0)
            up_and_product = 2 * N * width * cb
            tensors = self._lora_backward(always, saved, i) + self._forward_again(
                i, saved, full, unit_start, not_yet=up_and_product + down) + [
                Tensor("w_up's base output, update, scaled update and sum (LoRA)", "other",
                       self.cdt, 4 * N * width * cb)]
            if worst is None or _total(tensors) > _total(worst[1]):
                worst = (i, tensors)
        return {f"backward: recomputing layer {self.layers[worst[0]]}": ("backward", worst[1])
                } if worst else {}

    def _dequantise_moment(self, always, saved, full, unit_start) -> dict:
        """QLoRA dequantises each NF4 weight in its forward and again in its backward
        (``quant.QuantLinear``), making and freeing per weight: the unpacked codes (1 byte),
        their int64 indices into the codebook (8), the fp32 values (4), and the fp32 block
        scales (1/16) and the 16-level codebook once. The worst: a layer's largest weight in its
        backward (every layer kept, the residual stream's gradient in flight), or in a
        recomputed layer's forward run again (its unit rebuilt, ``_forward_again``); and the
        last layer's in the forward pass, beside the stream its forward holds."""
        if self.recipe.weight_format != "nf4":
            return {}
        c, last, worst = self.c, len(self.layers) - 1, {}
        for i in reversed(range(len(self.layers))):
            largest = max(w.numel for w in lora_targets(c, self.moe[i]))
            dequantised = Tensor("dequantised NF4 weight (codes, int64 indices, fp32 values, "
                                 "scales)", "other", "fp32",
                                 13 * largest + 4 * (largest // 64) + 64)
            if self.kept[unit_start[i]] != "none":
                moments = {"backward": self._lora_backward(always, saved, i) + self._forward_again(
                    i, saved, full, unit_start, not_yet=self.N * self.lora_rank * compute_bytes(
                        self.recipe.precision)) + [dequantised]}
            else:        # the down projection's base runs its backward after its adapter's
                width, r = self._mlp_width(self.moe[i]), self.lora_rank
                moments = {"backward": self._lora_backward(always, saved, i) + [dequantised, Tensor(
                    "gradients of the down projection's adapter", "grads", self.wdt,
                    r * (width + c.hidden) * self.bytes.grads)]}
                if i == last:   # what the forward pass makes is the tracker's "activations"
                    moments["forward"] = always + self._kept_up_to(saved, i) + [
                        replace(t, category="activations")
                        for t in (self._forward_locals(0), dequantised)]
            for phase, tensors in moments.items():
                if phase not in worst or _total(tensors) > _total(worst[phase][1]):
                    worst[phase] = (i, tensors)
        return {f"{phase}: dequantising layer {self.layers[i]}'s largest weight": (phase, tensors)
                for phase, (i, tensors) in worst.items()}

    def _lora_backward(self, always, saved, i: int) -> list[Tensor]:
        """What is alive in layer i's backward under LoRA: the states, what layers 0 .. i keep,
        the adapters' gradients of the layers done, the residual stream's gradient (and under
        autocast its bf16 copy, for the MLP's bf16 output); under FSDP2 (ZeRO-3) this block
        gathered and the next one's all-gather prefetched."""
        stream, wide = self.bytes.weights, self.N * self.c.hidden
        fsdp = ([self._gathered("this block", self.gathered_blocks[i]), *self._prefetched(i)]
                if self.fsdp2 else [])
        return always + self._kept_up_to(saved, i) + fsdp + [
            Tensor("gradients of the layers done", "grads", self.wdt,
                   sum(self.block_trained[i + 1:]) * stream),
            Tensor("gradient of the residual stream", "other", self.wdt, wide * stream),
            Tensor("its bf16 copy (autocast)", "other", "bf16", wide * 2 if self.mixed else 0)]

    def _forward_again(self, i: int, saved, full, unit_start, not_yet: int) -> list[Tensor]:
        """What a recomputed LoRA layer holds while its forward runs again inside its backward,
        ``not_yet`` bytes short of its unit rebuilt. Beside it: the gradient of the last
        adapter's (the down projection's) output scaled by alpha / r, made before the recompute
        starts (that adapter's x A^T is the first tensor unpacked) and held through it; and
        what the forward holds in Python's hands (``_forward_locals``)."""
        rebuilt = self._recomputed(i, saved, full, unit_start)
        held = self.N * self.c.hidden * compute_bytes(self.recipe.precision)
        return [replace(rebuilt, nbytes=rebuilt.nbytes - not_yet),
                Tensor("down projection's output gradient, scaled, held while recomputing (LoRA)",
                       "other", self.cdt, held),
                self._forward_locals(i - unit_start[i])]

    def _forward_locals(self, inner: int) -> Tensor:
        """What a block's forward holds in Python's hands at its MLP beside what autograd keeps.
        In a 16-bit stream, whose norms keep fp32 copies: the block's input and its mid-block
        sum; in a recomputed unit, the fp32 copy the unit's first norm rebuilds beside the kept
        input too (the rebuilt bytes take that input for it, as in an fp32 stream), in place of
        the input in the unit's first block and besides it ``inner`` > 0 blocks further. Under
        autocast: the MLP's fp32 input (its adapted linears keep bf16 copies)."""
        N, h, stream = self.N, self.c.hidden, self.bytes.weights
        if stream == 2:
            return Tensor("the block's 16-bit residual stream, held by its forward", "other",
                          self.wdt, (2 + (inner > 0)) * N * h * stream)
        return Tensor("the MLP's fp32 input, held by its forward (autocast)", "other", "fp32",
                      N * h * 4 if self.mixed else 0)

    def _embedding_moment(self, always) -> dict:
        """Backward ends in the embedding: every other gradient is done, its own is forming."""
        c, stream = self.c, self.bytes.weights
        # LoRA: the backward pass never reaches the frozen embedding
        embedding_grad = 0 if self.lora else c.vocab_size * c.hidden * stream // self.L.tp
        residual = Tensor("gradient of the residual stream", "other", self.wdt,
                          0 if self.lora else self.N * c.hidden * stream)
        grads = (self._grads_in_backward(range(len(self.layers))) if self.zero else
                 [Tensor("every other gradient", "grads", self.wdt,
                         self._done(self.n_train * self.bytes.grads - embedding_grad))])
        out = {"backward: embedding": ("backward", always + grads + [
            Tensor("embedding gradient being formed", "other", self.wdt, embedding_grad),
            residual])}
        if self.zero >= 2 and self.rest:    # the last unit done: the root's bucket reduced
            out["backward: reduce-scatter of the embedding, final norm and LM head"] = (
                "backward", always + grads + [self._reduced_shard(self.rest),
                                              self._staging(self.rest, self.bytes.grads)])
        return out

    def _optimizer_moment(self, always) -> dict:
        """The optimizer step: every gradient and state, and the step's temporaries. With
        master weights each rank swaps the bf16 gradients it updates for fp32 copies: all of
        them, or from ZeRO-1 on its shard (ZeRO-1 keeps the whole all-reduced bf16 gradients)."""
        temporaries = Tensor("AdamW8bit step temporaries (one chunk)" if self.eight_bit else
                             f"optimizer temporaries ({self.impl})",
                             HOST if self.offload else "other",
                             "fp32" if self.master else self.wdt, self._optimizer_temporaries())
        if self.zero:
            return self._zero_optimizer_moments(always, temporaries)
        return {"optimizer step": ("optimizer", always + [
            Tensor("gradients", "grads", self.wdt,
                   0 if self.master or self.in_buckets else self.grads()),
            Tensor("fp32 copies of the gradients", "other", "fp32",
                   self.n_train * 4 if self.master else 0),
            temporaries])}

    # ---- ZeRO over dp ranks: buckets, shards, gathered units, collectives ---------------------
    def _zero_optimizer_moments(self, always, temporaries) -> dict:
        """The step on the gradient shards (fp32 under master weights); before it stage 1
        reduce-scatters its whole bucket, after it stages 1 and 2 all-gather each unit's
        updated shard (the units after it still hold their gradient shards)."""
        units, ranks = self.units, self.unit_ranks
        out = {"optimizer step": ("optimizer", always + [self._shards(units, ranks), temporaries])}
        if self.zero == 1:             # each unit's bucket in turn (with ep: two)
            reduces = [always + self._buckets(k) + [
                self._shards(units[:k], ranks[:k]), self._reduced_shard(n, r),
                self._staging(n, self.bytes.grads, r)]
                for k, (n, r) in enumerate(zip(units, ranks))]
            out["optimizer step: reduce-scatter"] = ("optimizer", max(reduces, key=_total))
        if self.zero <= 2:
            gathers = [always + [self._shards(units[k + 1:], ranks[k + 1:]),
                                 Tensor("this rank's updated shard, copied", "other", self.wdt,
                                        zero.shard(n, r) * self.bytes.weights),
                                 self._staging(n, self.bytes.weights, r)]
                       for k, (n, r) in enumerate(zip(units, ranks))]
            out["optimizer step: all-gather"] = ("optimizer", max(gathers, key=_total))
        return out

    def _gather_moments(self, always, saved, kept) -> dict:
        """Stage 3 gathers each block before its forward (the worst: the last block, with every
        layer before it saved) and the root unit again when the backward pass starts."""
        last = len(self.layers) - 1
        out = {f"forward: gather of layer {self.layers[last]}": ("forward", always + (
            self._kept_up_to(saved, last - 1)) + [
            self._gathered("this block", self.gathered_blocks[last]),
            *self._gather_transients(self.gathered_blocks[last]),
            *self._all_gather_outputs(last)])}
        if self.gathered_rest:
            out["backward: gather of the embedding, final norm and LM head"] = (
                "backward", always + kept + self._gather_transients(self.gathered_rest))
        return out

    def _prefetched(self, i: int) -> list[Tensor]:
        """LoRA under ZeRO-3 is FSDP2's (labkit's ZeRO-3 trains every parameter): in layer i's
        backward (i = the layer count: the head's) FSDP2 has already all-gathered the block
        below into a flat buffer (its backward prefetch), copied out when that block's
        backward starts."""
        if not (self.fsdp2 and i > 0):
            return []
        return [Tensor("next block's all-gather output (FSDP2's backward prefetch)", "other",
                       self.wdt, zero.padded(self.gathered_blocks[i - 1], self.L.dp)
                       * self.bytes.weights)]

    def _all_gather_outputs(self, i: int) -> list[Tensor]:
        """LoRA under ZeRO-3 (FSDP2): as it copies block i's parameters out of its all-gather's
        flat output, FSDP2 still holds the previous all-gather's output (kept so that the next
        copy-in cannot reuse memory a copy-out still reads: torch 2.13's _fsdp_param_group.py,
        its prev_all_gather_state in wait_for_unshard)."""
        if not self.fsdp2:
            return []
        flat = [zero.padded(self.gathered_blocks[j], self.L.dp) * self.bytes.weights
                for j in (i, i - 1) if j >= 0]
        return [Tensor("all-gather outputs of this block and the one before (FSDP2)", "other",
                       self.wdt, sum(flat))]

    def _gather_transients(self, numel: int) -> list[Tensor]:
        """What an all-gather of a unit allocates besides its result: gloo's copy, and when
        offloaded the shard copied up from the host."""
        up = zero.shard(numel, self.L.dp) * self.bytes.weights if self.offload else 0
        return [self._staging(numel, self.bytes.weights),
                Tensor("this rank's shard, copied from the host", "other", self.wdt, up)]

    def _grads_in_backward(self, blocks_done) -> list[Tensor]:
        """The gradients a rank holds in the backward pass once the LM head's are made: stage 1
        the whole model's bucket (with ep, the experts' once an MoE block's backward is done: it
        is made by the block's last matmuls, when most of what the block kept is freed; with
        more micro-batches, from the second on); from
        stage 2 the root unit's bucket (embedding, final norm, head: reduced last) and the
        shards of the blocks done."""
        if self.zero == 1:   # after the first micro-batch every bucket is there until the step
            buckets = self._buckets(0)
            done = self.L.micro_batch_count > 1 or any(self.moe[j] for j in blocks_done)
            return buckets if done else buckets[:1]
        return [self._bucket("the embedding, final norm and LM head", self.rest),
                self._shards([self.block_trained[j] for j in blocks_done])]

    def _bucket(self, what: str, numel: int, ranks: int | None = None) -> Tensor:
        """A unit's full gradients, padded, while its backward runs."""
        return Tensor(f"gradient bucket of {what}", "grads", self.wdt,
                      zero.padded(numel, ranks or self.L.dp) * self.bytes.grads)

    def _buckets(self, first: int) -> list[Tensor]:
        """Stage 1's buckets of units ``first`` on: the whole model's, or with ep the
        replicated weights' and the experts'."""
        names = ["the whole model"] if len(self.units) == 1 else ["the replicated weights",
                                                                  "this rank's experts"]
        return [self._bucket(*unit) for unit in
                list(zip(names, self.units, self.unit_ranks))[first:]]

    def _shards(self, numels, ranks=None) -> Tensor:
        """This rank's averaged gradient shards of these units (fp32 under master weights)."""
        number = 4 if self.master else self.bytes.grads
        ranks = ranks or [self.L.dp] * len(numels)
        return Tensor("gradient shards", HOST if self.offload else "grads",
                      "fp32" if self.master else self.wdt,
                      sum(zero.shard(n, r) for n, r in zip(numels, ranks)) * number)

    def _reduced_shard(self, numel: int, ranks: int | None = None) -> Tensor:
        """The shard a reduce-scatter writes, in the gradients' dtype."""
        return Tensor("gradient shard being reduced", "grads", self.wdt,
                      zero.shard(numel, ranks or self.L.dp) * self.bytes.grads)

    def _gathered(self, what: str, numel: int) -> Tensor:
        """Stage 3: a unit's full parameters, all-gathered around its forward or backward."""
        return Tensor(f"gathered parameters of {what}", "params", self.wdt,
                      zero.padded(numel, self.L.dp) * self.bytes.weights)

    def _staging(self, numel: int, number: int, ranks: int | None = None) -> Tensor:
        """gloo's copy of a buffer it sends (the CPU backend; NCCL works in place; a group of
        one rank sends nothing)."""
        ranks = ranks or self.L.dp
        return Tensor("gloo's copy of the buffer sent", "other", self.wdt,
                      zero.padded(numel, ranks) * number if self.staged and ranks > 1 else 0)

    def _result(self, moments, saved) -> Estimate:
        peak = max(moments, key=lambda k: _total(moments[k][1]))
        phase, tensors = moments[peak]
        at_forward_end = _by_category(saved)
        out = Estimate(peak_phase=phase, **_by_category(tensors),
                       saved_activations=at_forward_end["activations"],
                       saved_weight_cache=at_forward_end["weight_cache"])
        out.tensors = [t for t in tensors if t.nbytes]
        out.moments = {k: _total(v) for k, (_, v) in moments.items()}
        states = _by_category(self.states())
        out.details = {"peak moment": peak, "optimizer implementation": self.impl,
                       "parameters on this device": self.n_local,
                       "layers on this device": len(self.layers),
                       "model states": {"params": states["params"],
                                        "grads": 0 if self.offload else self.grads(),
                                        "optimizer": states["optimizer"]}}
        if self.zero:        # what one collective sends at most: the largest flat unit
            gathered = self.gathered_blocks + [self.gathered_rest] if self.zero == 3 else []
            out.details["largest unit (elements)"] = max(
                [zero.padded(u, r) for u, r in zip(self.units, self.unit_ranks)]
                + [zero.padded(u, self.L.dp) for u in gathered])
        if self.L.ep > 1:
            out.details["bytes sent per step, by message"] = self._expert_messages()
            out.details["bytes sent per step"] = sum(
                out.details["bytes sent per step, by message"].values())
            out.details["assumes"] = [
                f"balanced routing: each rank's experts receive batch x seq x top_k = "
                f"{compose.routed_rows(self.c, self.B, self.T):,} rows per MoE layer; a skewed "
                f"router puts more rows, activations and bytes sent on the busiest rank "
                f"(labkit.parallel.expert.routing_imbalance measures it)"]
        elif self.L.dp > 1 and self.lora and self.zero == 3:   # adapters reduced, units gathered
            out.details["bytes sent per step"] = (
                zero.bytes_sent(self.units, 2, self.L.dp, self.bytes.grads, 0)
                + zero.bytes_sent(self.gathered_blocks + [self.gathered_rest], 3, self.L.dp, 0,
                                  self.bytes.weights))
        elif self.L.dp > 1:
            out.details["bytes sent per step"] = zero.bytes_sent(
                self.units, self.zero, self.L.dp, self.bytes.grads, self.bytes.weights)
        if self.offload:
            out.details["host memory"] = max(sum(t.nbytes for t in v if t.category == HOST)
                                             for _, v in moments.values())
            out.details["host <-> device bytes per step"] = self._offload_traffic()
        return out

    def _expert_messages(self) -> dict[str, int]:
        """What one of the dp ranks sends per step (``parallel.compose``): its all_to_alls for
        each micro-batch (rows in the stream's dtype out, the experts' outputs back in the
        matmuls'; the forward's again for each MoE block recomputed: labkit's selective policy
        keeps no all_to_all), the replicated gradients all-reduced over every rank, its
        experts' over their dp copies (or ZeRO-1's reduce-scatters and all-gathers), once."""
        L, c, grads = self.L, self.c, self.bytes.grads
        routed = sum(w.local(L.tp, L.ep) for w in self.weights if w.copies > 1)
        units = plan(len(self.layers), self.recipe.recompute, self.recipe.every)
        again = sum(self.moe[i] for u in units if u.recompute for i in range(u.first, u.last))

        def all_to_all(layers: int) -> dict[str, int]:
            return compose.all_to_all_bytes(c, self.B, self.T, L.ep, self.bytes.weights,
                                            compute_bytes(self.recipe.precision), layers)
        once, recomputed = all_to_all(sum(self.moe)), all_to_all(again)
        out = {k: L.micro_batch_count * (v + (recomputed[k] if "backward" not in k else 0))
               for k, v in once.items()}
        if not self.zero:
            return out | compose.gradient_bytes_sent((self.n_local - routed) * grads,
                                                     routed * grads, L.ep, L.dp // L.ep)
        for (n, r), group in zip(zip(self.units, self.unit_ranks), ("", " (experts, dp group)")):
            if r > 1:   # ZeRO-1: each unit's gradients reduce-scattered, its weights all-gathered
                out[f"reduce_scatter{group}"] = (r - 1) * zero.shard(n, r) * grads
                out[f"all_gather{group}"] = (r - 1) * zero.shard(n, r) * self.bytes.weights
        return out

    def _offload_traffic(self) -> int:
        """Bytes copied each step under offload: every gradient shard down to the host, and
        the updated parameter shards up, once (stages 1, 2) or at each gather (stage 3: two)."""
        shards = sum(zero.shard(n, r) for n, r in zip(self.units, self.unit_ranks))
        return shards * (self.bytes.grads + self.bytes.weights * (2 if self.zero == 3 else 1))

    # ---- transients ------------------------------------------------------------------------------
    def _first_grad(self, moe: bool) -> int:
        """The gradient autograd accumulates first in a block's backward: the MLP's down projection."""
        c = self.c
        if self.lora:        # its LoRA B (hidden x r)
            return c.hidden * self.lora_rank * self.bytes.weights
        width = (max(1, c.shared_experts) * c.moe_ffn if moe else c.ffn) // self.L.tp
        return c.hidden * width * self.bytes.weights

    def _layer_backward_transient(self, moe: bool) -> int:
        """Gradients of activations alive together inside an MLP's backward.

        SwiGLU: the gradients of silu(gate) and up exist while the product's gradient is held.
        MoE: the tokens' gradient gathered back to expert order, the gate-weight product and
        the experts' output gradient (in fp32 under autocast, then its bf16 copy).
        """
        c, N, stream = self.c, self.N, self.bytes.weights
        compute = 4 if self.recipe.precision == "fp32" else 2
        swiglu = 2 * N * self._mlp_width(moe) * compute
        if not moe:
            return swiglu
        routed = N * c.top_k * (c.hidden * (2 * stream + (2 if self.mixed else 0)) + 4)
        return max(swiglu, routed)

    def _mlp_width(self, moe: bool) -> int:
        """The SwiGLU's width on this rank: the dense MLP's, or an MoE layer's shared experts'."""
        return (self.c.shared_experts * self.c.moe_ffn if moe else self.c.ffn) // self.L.tp

    def _optimizer_temporaries(self) -> int:
        """Bytes the optimizer step allocates and frees: AdamW's sqrt(v) and bias correction.

        foreach makes them for every parameter at once. The for-loop makes two for each
        parameter in turn (sqrt(v), then / bc2) while the previous parameter's last one is
        still alive: the worst pair of neighbours in the model's order, 2 n_i + n_(i-1).
        AdamW8bit (any impl) steps each tensor a chunk at a time: its largest chunk's.
        """
        number = 4 if self.master else self.bytes.weights
        if self.eight_bit:
            return max(step_temporary_bytes(n, number) for n in self._stepped_sizes())
        if not self.recipe.optimizer.startswith("adamw") or self.impl == "fused":
            return 0
        if self.impl == "foreach":
            return self._per_rank(number, "optimizer")
        sizes = self._stepped_sizes()
        return max(2 * n + previous for n, previous in zip(sizes, [0] + sizes)) * number

    def _stepped_sizes(self) -> list[int]:
        """Numbers of each tensor the optimizer steps on this rank, in the model's order."""
        return ([zero.shard(n, r) for n, r in zip(self.units, self.unit_ranks)] if self.zero else
                [w.local(self.L.tp, self.L.ep) for w in self.trained])


def _total(tensors: list[Tensor]) -> int:
    """Device bytes: what is offloaded to the host is not counted."""
    return sum(t.nbytes for t in tensors if t.category != HOST)


def _by_category(tensors: list[Tensor]) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    for t in tensors:
        if t.category != HOST:
            out[t.category] += t.nbytes
    return out


def kv_cache_bytes(cfg: ModelConfig | str, batch: int = 1, seq: int = 4096,
                   dtype: str = "bf16", tp: int = 1) -> int:
    """Bytes of the inference KV cache: per token and layer 2 * kv_heads * head_dim numbers
    (MHA, GQA, MQA), or for MLA the latent plus the shared RoPE key, kv_lora + rope."""
    c = preset(cfg) if isinstance(cfg, str) else cfg
    check_positive("batch", batch)
    check_positive("seq", seq)
    Layout(tp=tp).check(c, seq)
    if c.attention == "mla":
        per_token = c.kv_lora_rank + c.qk_rope_dim                             # not split by tp
    else:
        per_token = 2 * max(1, c.kv_heads // tp) * c.head_dim
    return int(batch * seq * c.layers * per_token * dtype_bytes(dtype))
