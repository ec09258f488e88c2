"""The model states of one pipeline stage's step, and ZeRO's buckets, shards and gathers: a
mixin of ``step._Step``, reading what its ``__init__`` sets. Weights, gradients and optimizer
state by the recipe's bytes per parameter, each unit sharded over its ranks
(``parallel.data.zero``; with ep, the experts' unit over their dp / ep copies); what each
collective sends."""
from __future__ import annotations

from labkit.core.recipe import STATE_NUMBERS, compute_bytes
from labkit.core.recompute import plan
from labkit.core.units import HOST
from labkit.parallel.data import zero
from labkit.parallel.expert import compose
from labkit.predict.formats import (LOOKUP_BYTES, MAP_BYTES, eight_bit_state_bytes,
                                    nf4_bits_per_param, step_temporary_bytes)
from labkit.predict.layers import block_weights, lora_targets
from labkit.predict.terms import Tensor, _total

ROOT_REDUCED = "backward: reduce-scatter of the embedding, final norm and LM head"


class States:
    """Model states, ZeRO's terms and the bytes sent per step."""

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
                      on_device * self._per_rank(b.weights, "params")) if not self.policy else
               Tensor("fp32 weight shards (FSDP2's policy: the master weights)", "params",
                      "fp32", self._per_rank(4, "params")),
               *self._frozen_weights(),
               Tensor(f"{self.recipe.optimizer} state ({numbers} numbers per parameter)",
                      state, "int8" if self.recipe.optimizer == "adamw-8bit" else
                      ("fp32" if self.master else wdt), moments),
               Tensor("RoPE cos and sin tables", "other", "fp32", 2 * c.max_seq * c.rope_dim * 4)]
        if self.eight_bit:
            out += [Tensor("8-bit maps (2 x 256 values)", state, "fp32", MAP_BYTES),
                    Tensor("8-bit maps' lookup tables", "other", "fp32", LOOKUP_BYTES)]
        if (self.master and not self.policy) or self.offload:
            out.append(Tensor("fp32 master weights" if self.master else "weights' shard",
                              state, "fp32" if self.master else wdt,
                              self._per_rank(4 if self.master else b.weights, "optimizer")))
        if self.ddp:
            out.append(Tensor("DDP gradient buckets", "grads", wdt, n * self.bytes.grads))
        if self.recipe.optimizer == "adamw":   # one per stepped tensor: a ZeRO unit, or a
            steps = len(self.units) if self.zero and not self.policy else len(self.trained)
            out.append(Tensor("AdamW step counters", state, "fp32", 4 * steps))  # parameter
        return out

    def _per_rank(self, number: int, state: str) -> int:
        """Bytes one rank holds of a ``state`` of ``number`` bytes per trained parameter: all of
        them, or from the stage that shards it the rank's share of each unit."""
        if len({r for _, r in self.units}) == 1:
            return zero.per_rank(self.n_train * number, state, self.L.zero_stage, self.L.shard_ranks)
        if self.L.zero_stage < zero.SHARDED_FROM_STAGE[state]:
            return self.n_train * number
        return sum(zero.shard(n, r) for n, r in self.units) * number

    def _frozen_weights(self) -> list[Tensor]:
        """LoRA's frozen model: the targeted linears in ``weight_format`` (NF4: packed codes and
        double-quantised scales, ``quant.nf4_bits_per_param``, plus one fp32 mean of the scales
        per tensor), everything else (embedding, norms, router, routed experts, LM head) in the
        precision's dtype. No gradients, no optimizer state. Full fine-tuning: the weights
        that take no gradient (DeepSeek-V3's router biases), whole on every rank."""
        if not self.lora:
            frozen = (self.n_local - self.n_train) * self.bytes.weights
            return [Tensor("router biases (moved by the balancing rule, not trained)", "params",
                           self.wdt, frozen)] if frozen else []
        if self.zero == 3:         # FSDP2 shards the frozen base too; offloaded, on the host
            return [Tensor("frozen weights' shard", HOST if self.offload else "params",
                           f"nf4 + {self.wdt}" if self.recipe.weight_format else self.wdt,
                           self._frozen_shard())]
        numel = sum(w.local(self.L.tp) for w in self.targets)
        rest = (self.n_local - numel) * self.bytes.weights
        if self.recipe.weight_format == "nf4":
            return [Tensor("frozen linears of the blocks (NF4 codes and scales)", "params",
                           "nf4", self._nf4_bytes(self.targets)),
                    Tensor("frozen embedding, norms, LM head (not quantised)", "params",
                           self.wdt, rest)]
        return [Tensor("frozen weights", "params", self.wdt, numel * self.bytes.weights + rest)]

    def _nf4_bytes(self, targets) -> int:
        return sum(round(w.local(self.L.tp) * nf4_bits_per_param() / 8) + 4 for w in targets)

    def _block_stored(self, moe: bool) -> int:
        """Bytes of a LoRA block's frozen weights as stored (NF4: its targets' codes and
        scales), what FSDP2 shards and all-gathers (QLoRA's as bytes: FSDP-QLoRA)."""
        tp, ep, targets = self.L.tp, self.L.expert_ranks, lora_targets(self.c, moe)
        block = sum(w.local(tp, ep) for w in block_weights(self.c, moe))
        if self.recipe.weight_format != "nf4":
            return block * self.bytes.weights
        return (self._nf4_bytes(targets)
                + (block - sum(w.local(tp) for w in targets)) * self.bytes.weights)

    def _frozen_shard(self) -> int:
        """Bytes of LoRA's frozen base one rank keeps under FSDP2 (ZeRO-3): each block's units
        (less the adapters, in its first), and the embedding, final norm and LM head."""
        rest = (self.n_local - sum(self.block_params)) * self.bytes.weights
        blocks = sum(zero.shard(n - (k == 0) * t, r) for units, t in
                     zip(self.gathered_units, self.block_trained) for k, (n, r) in enumerate(units))
        return zero.per_rank(rest, "params", 3, self.L.shard_ranks) + blocks * self.bytes.weights

    def grads(self) -> int:
        """A rank's finished gradients: all, or from stage 2 its shard of each unit (fp32 under
        FSDP2's policy)."""
        return 0 if self.in_buckets else self._per_rank(4 if self.policy else self.bytes.grads,
                                                        "grads")

    def _done(self, grad_bytes: int) -> int:
        """What a rank keeps of finished gradients apart from DDP's buckets (nothing when the
        gradients are views of them)."""
        if self.in_buckets or self.in_backward:      # in backward: stepped, then freed
            return 0
        return zero.per_rank(grad_bytes, "grads", self.L.zero_stage, self.L.shard_ranks)

    # ---- ZeRO over dp ranks: buckets, shards, gathered units, collectives ---------------------
    def _zero_optimizer_moments(self, always, temporaries) -> dict:
        """The step on the gradient shards (fp32 under master weights); before it stage 1
        reduce-scatters its whole bucket, after it stages 1 and 2 all-gather each unit's
        updated shard (the units after it still hold their gradient shards)."""
        units = self.units
        out = {"optimizer step": ("optimizer", always + [self._shards(units), temporaries])}
        if self.zero == 1:             # each unit's bucket in turn (with ep: two)
            reduces = [always + self._buckets(k) + [
                self._shards(units[:k]), self._reduced_shard([unit]),
                self._staging([unit], self.bytes.grads)] for k, unit in enumerate(units)]
            out["optimizer step: reduce-scatter"] = ("optimizer", max(reduces, key=_total))
        if self.zero <= 2:
            gathers = [always + [self._shards(units[k + 1:]),
                                 Tensor("this rank's updated shard, copied", "other", self.wdt,
                                        zero.shard(*unit) * self.bytes.weights),
                                 self._staging([unit], self.bytes.weights)]
                       for k, unit in enumerate(units)]
            out["optimizer step: all-gather"] = ("optimizer", max(gathers, key=_total))
        return out

    def _gather_moments(self, always, saved, kept) -> dict:
        """Stage 3 gathers each block before its forward (the worst: the last block, with every
        layer before it saved) and the root unit again when the backward pass starts."""
        last = len(self.layers) - 1
        out = {f"forward: gather of layer {self.layers[last]}": ("forward", always + (
            self._kept_up_to(saved, last - 1)) + [
            self._gathered("this block", self.gathered_units[last]),
            *self._gather_transients(self.gathered_units[last]),
            *self._all_gather_outputs(last)])}
        if self.gathered_rest:
            out["backward: gather of the embedding, final norm and LM head"] = (
                "backward", always + kept + self._gather_transients(self.gathered_rest))
        return out

    def _prefetched(self, i: int) -> list[Tensor]:
        """Under FSDP2 (LoRA's ZeRO-3, or ZeRO-3 under its MixedPrecisionPolicy): in layer i's
        backward (i = the layer count: the head's) FSDP2 has already all-gathered the block
        below into a flat buffer (its backward prefetch), copied out when that block's
        backward starts."""
        if not (self.fsdp2 and i > 0):
            return []
        return [Tensor("next block's all-gather output (FSDP2's backward prefetch)", "other",
                       self.wdt, self._gathered_bytes(i - 1))]

    def _all_gather_outputs(self, i: int) -> list[Tensor]:
        """LoRA under ZeRO-3 (FSDP2): as it copies block i's parameters out of its all-gather's
        flat output, FSDP2 still holds the previous all-gather's output (kept so that the next
        copy-in cannot reuse memory a copy-out still reads: torch 2.13's _fsdp_param_group.py,
        its prev_all_gather_state in wait_for_unshard)."""
        if not self.fsdp2:
            return []
        flat = [self._gathered_bytes(j) for j in (i, i - 1) if j >= 0]
        return [Tensor("all-gather outputs of this block and the one before (FSDP2)", "other",
                       self.wdt, sum(flat))]

    def _gathered_bytes(self, j: int) -> int:
        """Bytes of block j's all-gather output (FSDP2: every parameter, padded per group)."""
        return sum(zero.padded(n, r) for n, r in self.gathered_units[j]) * self.bytes.weights

    def _gather_transients(self, unit) -> list[Tensor]:
        """What an all-gather of a unit allocates besides its result: gloo's copy, and when
        offloaded the shard copied up from the host."""
        up = sum(zero.shard(n, r) for n, r in self._parts(unit)) if self.offload else 0
        return [self._staging(unit, self.bytes.weights),
                Tensor("this rank's shard, copied from the host", "other", self.wdt,
                       up * self.bytes.weights)]

    def _grads_in_backward(self, blocks_done) -> list[Tensor]:
        """The gradients a rank holds in the backward pass once the LM head's are made: stage 1
        the whole model's bucket (with ep, the experts' once an MoE block's backward is done:
        ``moments._experts_bucket``); from stage 2 the root unit's bucket (embedding, final
        norm, head: reduced last) and the shards of the blocks done. From the second
        micro-batch on, every bucket (stage 1) or shard (from stage 2) is there."""
        if self.policy:
            return self._fsdp2_grads_in_backward(blocks_done)
        if self.zero == 1:   # after the first micro-batch every bucket is there until the step
            buckets = self._buckets(0)
            done = self.L.micro_batch_count > 1 or any(self.moe[j] for j in blocks_done)
            return buckets if done else buckets[:1]
        if self.L.micro_batch_count > 1:     # from the second on, every unit's shard is there
            return [self._bucket("the embedding, final norm and LM head", self.rest),
                    self._shards(self.units)]
        return [self._bucket("the embedding, final norm and LM head", self.rest),
                self._shards([u for j in blocks_done for u in self.block_units[j]])]

    def _fsdp2_grads_in_backward(self, blocks_done) -> list[Tensor]:
        """FSDP2 under its MixedPrecisionPolicy: the root (embedding, final norm, head) is
        reduced last, so the head's and final norm's unsharded bf16 gradients wait; the fp32
        shards of the blocks done (every unit's from the second micro-batch); and the fp32
        reduce-scatter input of the block reduced last, which FSDP2 keeps until the next
        block's reduce-scatter (torch 2.13's _fsdp_param_group.py, post_backward)."""
        done = list(blocks_done)
        head = Tensor("unsharded gradients of the LM head and final norm (FSDP2: the root is "
                      "reduced last)", "grads", self.wdt,
                      self._head_grad_elements() * self.bytes.grads if self.last else 0)
        shards = self._shards(self.units if self.L.micro_batch_count > 1 else
                              [u for j in done for u in self.block_units[j]])
        if not done:
            return [head, shards]
        last = Tensor("reduce-scatter input of the block reduced last, fp32 (FSDP2 keeps it "
                      "until the next)", "other", "fp32",
                      4 * sum(zero.padded(n, r) for n, r in self.block_units[min(done)]))
        return [head, shards, last]

    def _this_block_in_backward(self, i: int) -> list[Tensor]:
        """What ZeRO holds for block i during its backward: from stage 2 its flat gradient
        bucket (under FSDP2's policy it stands for the block's bf16 gradients, which FSDP2
        makes one by one: a bound, up to 7% above FSDP2's peak), at stage 3 its gathered
        weights, under FSDP2 the block below prefetched."""
        bucket = [self._bucket("this block", self.block_units[i][:1])] if self.zero >= 2 else []
        gathered = [self._gathered("this block", self.gathered_units[i])] if self.zero == 3 else []
        return bucket + gathered + self._prefetched(i)

    def _fsdp2_root_moment(self, always) -> dict:
        """FSDP2's policy ends the backward reducing the root (embedding, final norm, LM head):
        its unsharded bf16 gradients and their fp32 copy, the reduce-scatter's input, beside
        every block's fp32 shard; its gathered weights are resharded by then (``step`` adds
        them to every other backward moment)."""
        whole = zero.padded(self.rest, self.L.shard_ranks)
        return {ROOT_REDUCED: (
            "backward", always + [
                self._shards(self.units if self.L.micro_batch_count > 1 else
                             [u for b in self.block_units for u in b]),
                Tensor("unsharded gradients of the embedding, final norm and LM head", "grads",
                       self.wdt, whole * self.bytes.grads),
                Tensor("their fp32 copy, the reduce-scatter's input (FSDP2's reduce_dtype)",
                       "other", "fp32", whole * 4)])}

    def _parts(self, unit) -> list[tuple[int, int]]:
        """[(elements, ranks)] of a unit given as its elements (sharded over dp) or its parts
        (a block's replicated weights over dp, its experts over dp / ep)."""
        return unit if isinstance(unit, list) else [(unit, self.L.shard_ranks)]

    def _bucket(self, what: str, unit) -> Tensor:
        """A unit's full gradients, padded, while its backward runs."""
        return Tensor(f"gradient bucket of {what}", "grads", self.wdt,
                      sum(zero.padded(n, r) for n, r in self._parts(unit)) * self.bytes.grads)

    def _buckets(self, first: int) -> list[Tensor]:
        """Stage 1's buckets of units ``first`` on: the whole model's, or with ep the
        replicated weights' and the experts'."""
        names = ["the whole model"] if len(self.units) == 1 else ["the replicated weights",
                                                                  "this rank's experts"]
        return [self._bucket(name, [unit]) for name, unit in list(zip(names, self.units))[first:]]

    def _shards(self, units) -> Tensor:
        """This rank's averaged gradient shards of these units, each (elements, ranks) (fp32
        under master weights)."""
        number = 4 if self.master else self.bytes.grads
        return Tensor("gradient shards", HOST if self.offload else "grads",
                      "fp32" if self.master else self.wdt,
                      sum(zero.shard(n, r) for n, r in units) * number)

    def _reduced_shard(self, unit) -> Tensor:
        """The shard a reduce-scatter writes, in the gradients' dtype."""
        number = 4 if self.policy else self.bytes.grads      # FSDP2's policy: fp32
        return Tensor("gradient shard being reduced", "grads", "fp32" if self.policy else self.wdt,
                      sum(zero.shard(n, r) for n, r in self._parts(unit)) * number)

    def _gathered(self, what: str, unit) -> Tensor:
        """Stage 3: a unit's full parameters, all-gathered around its forward or backward."""
        return Tensor(f"gathered parameters of {what}", "params", self.wdt,
                      sum(zero.padded(n, r) for n, r in self._parts(unit)) * self.bytes.weights)

    def _staging(self, unit, number: int) -> Tensor:
        """gloo's copy of a buffer it sends (the CPU backend; NCCL works in place; a group of
        one rank sends nothing)."""
        staged = sum(zero.padded(n, r) for n, r in self._parts(unit) if r > 1)
        return Tensor("gloo's copy of the buffer sent", "other", self.wdt,
                      staged * number if self.staged else 0)

    def _expert_messages(self) -> dict[str, int]:
        """What one of the dp ranks sends per step (``parallel.expert.compose``): its all_to_alls
        for each micro-batch (rows in the stream's dtype out, the experts' outputs back in the
        matmuls'; the forward's again for each MoE block recomputed: labkit's selective policy
        keeps no all_to_all), the replicated gradients all-reduced over every rank, its
        experts' over their dp copies (or ZeRO's reduce-scatters and all-gathers), once."""
        L, c, grads = self.L, self.c, self.bytes.grads
        routed = sum(w.local(L.tp, L.expert_ranks) for w in self.weights if w.copies > 1)
        units = plan(len(self.layers), self.recipe.recompute, self.recipe.every)
        again = sum(self.moe[i] for u in units if u.recompute for i in range(u.first, u.last))

        def all_to_all(layers: int) -> dict[str, int]:
            return compose.all_to_all_bytes(c, self.B, self.T, L.ep, self.bytes.weights,
                                            compute_bytes(self.recipe.precision), layers, L.etp)
        once, recomputed = all_to_all(sum(self.moe)), all_to_all(again)
        out = {k: L.micro_batch_count * (v + (recomputed[k] if "backward" not in k else 0))
               for k, v in once.items()}
        if self.lora:                      # the adapters train; the experts are frozen
            routed = 0
        if not self.zero:
            replicated = self.n_train - routed       # the frozen router bias is not sent
            return out | compose.gradient_bytes_sent(replicated * grads, routed * grads,
                                                     L.expert_ranks, L.data_ranks // L.expert_ranks)
        scatters, gathers = zero.zero_messages(self.zero, L.micro_batch_count)
        # each unit's gradients reduce-scattered, its weights all-gathered (LoRA under FSDP2:
        # every block's frozen weights too, and the root's)
        gathered = ([u for b in self.gathered_units for u in b] + [(self.gathered_rest, L.shard_ranks)]
                    if self.fsdp2 else self.units)
        for kind, units, times, number in (("reduce_scatter", self.units, scatters, grads),
                                           ("all_gather", gathered, gathers, self.bytes.weights)):
            for n, r in units:
                if r > 1:
                    key = kind + ("" if r == L.shard_ranks else " (experts, dp group)")
                    out[key] = out.get(key, 0) + times * (r - 1) * zero.shard(n, r) * number
        return out

    def _offload_traffic(self) -> int:
        """Bytes copied each step under offload: every gradient shard down to the host, and
        the updated parameter shards up, once (stages 1, 2) or at each gather (stage 3: two;
        under LoRA FSDP2 copies the frozen base's shards up at each gather too, two per
        micro-batch; not measured here: fake FSDP2 runs without CPUOffloadPolicy)."""
        shards = sum(zero.shard(n, r) for n, r in self.units)
        frozen = 2 * self.L.micro_batch_count * self._frozen_shard() if self.fsdp2 else 0
        return shards * (self.bytes.grads + self.bytes.weights * (2 if self.zero == 3 else 1)) \
            + frozen

    def _optimizer_temporaries(self) -> int:
        """Bytes the optimizer step allocates and frees: AdamW's sqrt(v) and bias correction.

        foreach makes them for every parameter at once. The for-loop makes two for each
        parameter in turn (sqrt(v), then / bc2) while the previous parameter's last one is
        still alive: the worst pair of neighbours in the model's order, 2 n_i + n_(i-1).
        AdamW8bit (any impl) steps each tensor a chunk at a time: its largest chunk's.
        """
        number = 4 if self.master else self.bytes.weights
        if self.in_backward:
            return self.step_temporaries(max(self._stepped_sizes(), default=0))
        if self.eight_bit:
            return max(step_temporary_bytes(n, number) for n in self._stepped_sizes())
        if not self.recipe.optimizer.startswith("adamw") or self.impl == "fused":
            return 0
        if self.impl == "foreach":
            return self._per_rank(number, "optimizer")
        sizes = self._stepped_sizes()
        return max(2 * n + previous for n, previous in zip(sizes, [0] + sizes)) * number

    def step_temporaries(self, numel: int) -> int:
        """Bytes of one weight's step alone (``optimizer_in_backward``): AdamW's sqrt(v) (and
        its bias-corrected copy in the for-loop), or AdamW8bit's largest chunk's."""
        if self.eight_bit:
            return step_temporary_bytes(numel, self.bytes.weights) if numel else 0
        if not self.recipe.optimizer.startswith("adamw"):
            return 0
        return {"foreach": 1, "for-loop": 2}.get(self.impl, 0) * numel * self.bytes.weights

    def _stepped_sizes(self) -> list[int]:
        """Numbers of each tensor the optimizer steps on this rank, in the model's order."""
        return ([zero.shard(n, r) for n, r in self.units] if self.zero else
                [w.local(self.L.tp, self.L.expert_ranks) for w in self.trained])
