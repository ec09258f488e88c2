"""One pipeline stage's step as named tensors: what it holds (``states``), what each layer keeps
for the backward pass, and the largest of its moments (``moments``)."""
from __future__ import annotations

from collections import defaultdict

from labkit.core.recipe import Layout, Recipe, state_bytes
from labkit.core.recompute import parse_policy, plan
from labkit.core.units import HOST
from labkit.parallel.data import zero
from labkit.parallel.expert import compose
from labkit.parallel.pipeline import schedules
from labkit.predict.layers import (Saved, Term, Weight, block_weights, embedding_weights,
                                   head_saved, head_weights, layer_saved, lora_targets,
                                   lora_weights)
from labkit.predict.in_backward import InBackwardMoments
from labkit.predict.moments import Moments
from labkit.predict.states import ROOT_REDUCED, States
from labkit.predict.terms import Estimate, Tensor, _by_category, _total

# the moments of the backward pass before it reaches the last block
HEAD_BACKWARD = ("backward: start", "backward: loss", "backward: LM head", "backward: final norm")


def _split_units(n: int, experts: int, dp: int, ep: int) -> list[tuple[int, int]]:
    """A block's ZeRO units, (elements, ranks): its experts' shard over their dp / ep copies,
    the rest over every dp rank."""
    return [(n - experts, dp), (experts, dp // ep)] if experts else [(n, dp)]


class _Step(States, Moments, InBackwardMoments):
    """One pipeline stage's step: its model states, its saved tensors, its moments."""

    def __init__(self, c, batch, seq, recipe, layout, device, stage, layers):
        self.c, self.recipe, self.L = c, recipe, layout
        self.B, self.T = batch, seq // layout.cp                 # tokens on this rank
        self.N = self.B * self.T
        self._names: dict = {}        # id(Saved) -> (it, its bytes by name): see _by_name
        self.layers = list(layers)
        # in a V (ZB-V, DualPipeV) stage 0 holds the first chunk and the last, with the head
        ends_on = 0 if layout.placement == "v" else layout.pp - 1
        self.stage, self.first, self.last = stage, stage == 0, stage == ends_on
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
        self.in_backward = recipe.optimizer_in_backward     # each weight stepped as its grad is made
        self._count_weights()
        self._zero_units()
        # gloo (CPU) stages a copy of every buffer it sends; NCCL works in place
        self.staged = device == "cpu"
        # DDP (dp > 1 without ZeRO) keeps flat gradient buckets for the whole run; with
        # gradient_as_bucket_view the gradients are views of them instead of a second copy
        # (labkit's expert-parallel step averages in place instead: ``Layout.ddp_buckets``)
        self.ddp = layout.data_ranks > 1 and layout.zero_stage == 0 and layout.keeps_ddp_buckets
        self.in_buckets = self.ddp and layout.gradient_as_bucket_view

    def _count_weights(self):
        """The stage's weights in model order, per block, and what of them trains."""
        c, recipe, layout = self.c, self.recipe, self.L
        tp, ep = layout.tp, layout.expert_ranks          # the experts split over ep x etp
        self.moe = [i >= c.dense_layers for i in self.layers]
        kinds = {m: block_weights(c, m) for m in set(self.moe)}      # a dense and an MoE block
        self.blocks = [kinds[m] for m in self.moe]
        self.block_params = [sum(w.local(tp, ep) for w in ws) for ws in self.blocks]
        self.weights: list[Weight] = ((embedding_weights(c) if self.first else [])   # model order
                                      + [w for ws in self.blocks for w in ws]
                                      + (head_weights(c) if self.last else []))
        self.n_local = sum(w.local(tp, ep) for w in self.weights)
        # what trains: every weight, or LoRA's adapters on the frozen model
        # (``labkit.quantisation.lora``), with every layout: ZeRO-1/2 over the adapters, ZeRO-3 as
        # FSDP2's (the frozen base sharded too, QLoRA's NF4 as bytes: FSDP-QLoRA), tp and sp as
        # Megatron's parallel LoRA splits the adapters (``parallel.tensor``), pp, ep (the experts
        # frozen), cp, offload
        self.lora = recipe.trainable == "lora"
        self.lora_rank = recipe.lora_rank if self.lora else 0
        self.targets = [w for m in self.moe for w in lora_targets(c, m)] if self.lora else []
        self.trained = ([w for m in self.moe for w in lora_weights(c, m, self.lora_rank)]
                        if self.lora else [w for w in self.weights if w.trains])
        self.n_train = sum(w.local(tp, ep) for w in self.trained)
        self.block_trained = ([sum(w.local(tp) for w in lora_weights(c, m, self.lora_rank))
                               for m in self.moe] if self.lora else
                              [sum(w.local(tp, ep) for w in ws if w.trains) for ws in self.blocks])

    def _zero_units(self):
        """ZeRO over dp > 1 ranks works on flat units (``parallel.data.zero.units``): the rest of
        the model (embedding, final norm, LM head), then each block; stage 1: the whole model."""
        c, layout = self.c, self.L
        tp, ep = layout.tp, layout.expert_ranks
        self.zero = layout.zero_stage if layout.data_ranks > 1 or layout.offload else 0
        self.offload = layout.offload           # ZeRO's shards (from stage 3 params too) on the host
        rest = (embedding_weights(c) if self.first else []) + (head_weights(c) if self.last else [])
        rest_params = sum(w.local(tp, ep) for w in rest)
        # what ZeRO steps and reduces is what trains: LoRA's adapters, each block's in its unit
        # (the root unit - embedding, final norm, LM head - is frozen); stage 3 (FSDP) gathers
        # every parameter of a unit, LoRA's frozen base too
        # with ep, the experts' parameters form units of their own, sharded over their dp / ep
        # copies (``parallel.data.zero_step``'s experts; Megatron's distributed optimizer, FSDP
        # over experts): stage 1 one, from stage 2 one per MoE block. Units: (elements, ranks)
        experts = [sum(w.local(tp, ep) for w in ws if w.copies > 1) if ep > 1 else 0
                   for ws in self.blocks]
        routed = [0] * len(experts) if self.lora else experts        # LoRA: experts frozen
        self.block_units = [_split_units(n, e, layout.shard_ranks, ep)
                            for n, e in zip(self.block_trained, routed)]
        root = 0 if self.lora else rest_params
        if self.zero >= 2:
            parts = [(root, layout.shard_ranks)] * bool(root) + [u for b in self.block_units for u in b]
        else:
            whole = root + sum(self.block_trained)
            parts = ([(whole - sum(routed), layout.shard_ranks), (sum(routed), layout.data_ranks // ep)]
                     if sum(routed) and self.zero else [(whole, layout.shard_ranks)])
        self.units = parts                 # (elements, the ranks they are sharded over)
        self.rest = rest_params if self.zero >= 2 and rest and not self.lora else 0
        # LoRA's blocks as FSDP2 gathers them, in weight-sized elements (NF4's are fewer bytes),
        # each expert shard's frozen weights over its dp / ep copies
        self.gathered_units = ([_split_units(-(-self._block_stored(m) // self.bytes.weights) + t,
                                             e, layout.shard_ranks, ep)
                                for m, t, e in zip(self.moe, self.block_trained, experts)]
                               if self.lora else self.block_units)
        self.gathered_rest = rest_params if self.zero == 3 else 0
        # LoRA's ZeRO-3 is FSDP2's, and so is ZeRO-3 under its MixedPrecisionPolicy: its
        # buffers count (the policy: fp32 shards are the masters, no bf16 shard beside them)
        self.policy = layout.param_dtype is not None
        self.fsdp2 = (self.lora and self.zero == 3) or self.policy

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
        full = [self._with_permutations(layer_saved(c, p, m, L.tp, "none", L.sp, L.expert_ranks,
                                                    **lora[j], attention=self.recipe.attention,
                                                    layer=self.layers[j], etp=L.etp), m)
                for j, m in enumerate(self.moe)]
        saved = [Saved() if kept[j] == "nothing" else full[j] if kept[j] == "none" else
                 layer_saved(c, p, m, L.tp, kept[j], L.sp, L.expert_ranks, **lora[j],
                             layer=self.layers[j], etp=L.etp)
                 for j, m in enumerate(self.moe)]
        self.kept = kept
        return saved, full, {i: u.first for u in units for i in range(u.first, u.last)}

    def _with_permutations(self, saved: Saved, moe: bool) -> Saved:
        """Under expert parallelism an MoE layer also keeps the two int64 permutations that
        regroup the rows its experts received by expert and back (top_k rows per token, etp x
        as many gathered under expert tensor parallelism)."""
        if not (moe and self.L.expert_ranks > 1):
            return saved
        return Saved(saved + [Term("expert-parallel permutations (argsort and its inverse)",
                                   "int64", compose.permutation_bytes(self.c.top_k * self.L.etp))])

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
        v = self.L.chunks
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
                   **self._head_step_moment(always + kept, head),
                   **self._worst_layer_moment(always, saved, full, unit_start),
                   **self._naive_attention_moment(always, saved, full, unit_start),
                   **(self._embedding_moment(always) if self.first else {}),
                   **self._optimizer_moment(always),
                   **self._lora_recompute_moment(always, saved, full, unit_start),
                   **self._dequantise_moment(always, saved, full, unit_start)}
        if self.zero == 3:
            moments.update(self._gather_moments(always, saved, kept + head))
        if self.zero and self.split and self.L.micro_batch_count > 1:
            # ZeRO's moments stand for a later micro-batch: stage s's late W's are pending
            pending = self._kept_for_w(self._pending_w(at_w=False))
            for phase, tensors in moments.values():
                if phase != "optimizer":
                    tensors.append(pending)
        moments.update(self._later_micro_batch_moments(always, saved, label))
        if self.zero == 3:
            for name, (phase, tensors) in moments.items():   # the root stays gathered throughout
                if phase != "optimizer" and not (self.policy and name == ROOT_REDUCED):
                    tensors.append(self._gathered("the embedding, final norm and LM head",
                                                  self.gathered_rest))
                if name.startswith(HEAD_BACKWARD):  # the last block's gather is under way
                    tensors += self._prefetched(len(self.layers))
        return self._result(moments, saved=always + kept + head)

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
                                        "grads": 0 if self.offload or self.in_backward else self.grads(),
                                        "optimizer": states["optimizer"]}}
        if self.zero:        # what one collective sends at most: the largest flat unit
            gathered = ([u for b in self.gathered_units for u in b]
                        + [(self.gathered_rest, self.L.shard_ranks)] if self.zero == 3 else [])
            out.details["largest unit (elements)"] = max(
                zero.padded(n, r) for n, r in self.units + gathered)
        if self.L.expert_ranks > 1:
            out.details["bytes sent per step, by message"] = self._expert_messages()
            out.details["bytes sent per step"] = sum(
                out.details["bytes sent per step, by message"].values())
            out.details["assumes"] = [
                f"balanced routing: each rank's experts receive batch x seq x top_k = "
                f"{compose.routed_rows(self.c, self.B, self.T):,} rows per MoE layer; a skewed "
                f"router puts more rows, activations and bytes sent on the busiest rank "
                f"(labkit.parallel.expert.expert_parallel.routing_imbalance measures it)"]
        elif self.L.data_ranks > 1 and self.lora and self.zero == 3:   # adapters reduced, units gathered
            out.details["bytes sent per step"] = (
                zero.bytes_sent([n for n, _ in self.units], 2, self.L.data_ranks, self.bytes.grads, 0,
                                self.L.micro_batch_count)
                + zero.bytes_sent([n for b in self.gathered_units for n, _ in b]
                                  + [self.gathered_rest], 3, self.L.data_ranks, 0, self.bytes.weights,
                                  self.L.micro_batch_count))
        elif self.L.data_ranks > 1:
            numels, L = [n for n, _ in self.units], self.L
            grads = 4 if self.policy else self.bytes.grads     # FSDP2's policy reduces in fp32
            # FSDP2 keeps the root gathered from its forward through its backward: one gather
            root = (L.shard_ranks - 1) * zero.shard(self.rest, L.shard_ranks) * \
                self.bytes.weights * L.micro_batch_count if self.policy else 0
            out.details["bytes sent per step"] = zero.bytes_sent(
                numels, self.zero, L.shard_ranks, grads, self.bytes.weights,
                L.micro_batch_count) - root + zero.replica_bytes(
                numels, self.zero, L.shard_ranks, L.replicas, grads, L.micro_batch_count)
        if self.policy:
            out.details.setdefault("assumes", []).extend(self._policy_assumes(out))
        if self.offload:
            out.details["host memory"] = max(sum(t.nbytes for t in v if t.category == HOST)
                                             for _, v in moments.values())
            out.details["host <-> device bytes per step"] = self._offload_traffic()
        return out

    def _policy_assumes(self, out) -> list[str]:
        """What the estimate of FSDP2's MixedPrecisionPolicy assumes where it is not exact."""
        said, L = [], self.L
        if out.details["peak moment"].startswith(("backward: layer", "backward: reduce-scatter of layer")):
            said.append("FSDP2's MixedPrecisionPolicy, the peak inside a block's backward: a bound, "
                        "up to 7% above FSDP2's own (fake FSDP2 runs: measured / estimated 0.93-1.00)")
        rows = {self.c.vocab_size} | {w.fan_out for w in self.weights if w.name != "embed"}
        if any(n % L.shard_ranks for n in rows):
            said.append("FSDP2 pads each tensor's first dimension to a multiple of the ranks; "
                        "where one does not divide, rank 0 holds up to N - 1 more rows per "
                        "tensor, not counted (measured up to 1.6% above the estimate at N 1024)")
        if self.recipe.optimizer != "adamw":
            said.append("measured against FSDP2 with AdamW only")
        if self.c.is_moe and self.c.routed_experts % L.shard_ranks:
            said.append("the routed experts split evenly over the ranks (FSDP2's shard_placement_fn); "
                        "FSDP2's default Shard(0) pads each stacked tensor to N rows")
        if L.micro_batch_count > 1 or L.tp > 1 or L.cp > 1:
            said.append("FSDP2 reduces after every micro-batch (its default); tp, cp and "
                        "accumulation under the policy are not measured against FSDP2")
        return said

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
