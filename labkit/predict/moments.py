"""The moments of one pipeline stage's step: a mixin of ``step._Step``. The loss, each layer's
backward, a naive attention's scores, later micro-batches, the embedding's backward, the
optimizer step, LoRA's forward run again and NF4's dequantisation: each a dict of
name -> (phase, the tensors alive then)."""
from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

from labkit.core.recipe import SPLIT_BACKWARD, compute_bytes
from labkit.core.units import HOST
from labkit.parallel.pipeline import schedules
from labkit.predict.layers import (MLP_POST_NORM, SOFTMAX, Saved, block_weights,
                                   embedding_weights, head_weights, lora_targets)
from labkit.predict.naive import naive_backward_alive
from labkit.predict.terms import Tensor, _total


class Moments:
    """The step's candidate peaks."""

    def _loss_moments(self, kept: list[Tensor], head: list[Tensor]) -> dict:
        """The forward pass at the loss (logits and log-softmax side by side) and the start of
        backward (the log-softmax's and the logits' gradients), both (N, V) fp32."""
        c, tp, alive = self.c, self.L.tp, kept + head
        # autocast caches each weight's bf16 copy until the forward pass ends; a recomputed
        # layer saves none of them, so for it the cache is extra. Under LoRA nothing is cached:
        # autocast caches leaf weights that train, and the adapters reach their matmuls as A^T
        cache = sum(2 * sum(w.local(tp, self.L.expert_ranks) for w in block_weights(c, m) if w.matmul)
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
        head's backward forms its weight's gradient (LoRA: frozen, none) and its input's;
        under sp it all-gathers its input again and reduce-scatters the input's gradient to
        this rank's tokens."""
        c, tp, sp, cb = self.c, self.L.tp, self.L.sp, (4 if self.cdt == "fp32" else 2)
        wide = self.N * c.hidden * cb                                          # (N, hidden)
        logits = self.N * c.vocab_size // tp                                   # (N, V/tp)
        sixteen = Tensor("16-bit logits (gradient)", "other", self.cdt,
                         logits * 2 if cb == 2 else 0)
        # with 16-bit matmuls this micro-batch's fp32 softmax is gone once cast to 16 bits
        softmax_freed = [replace(t, nbytes=t.nbytes - logits * 4)
                         if cb == 2 and t.name == SOFTMAX else t for t in alive]
        head = [sixteen,
                Tensor("LM head gradient being formed", "other", self.cdt,   # LoRA: frozen
                       0 if self.lora else c.vocab_size // tp * c.hidden * cb),
                Tensor("gradient of the LM head's input", "other", self.cdt, wide)]
        if sp and self.lora:   # frozen: no input kept or gathered; its gradient summed, a copy
            head.append(Tensor("the gradient's sum over the head's matmuls (sp)", "other",
                               self.cdt, wide))
        elif sp:
            head += [Tensor("LM head's input, all-gathered again (sp)", "other", self.cdt, wide),
                     Tensor("this rank's tokens of its gradient (sp)", "other", self.cdt,
                            wide // tp)]
        return {"forward: loss": ("forward", alive + [sixteen, cache]),
                "backward: loss": ("backward", alive + [sixteen]),
                "backward: LM head": ("backward", softmax_freed + head)}

    def _chunked_loss_moments(self, kept: list[Tensor], head: list[Tensor], cache: Tensor) -> dict:
        """A chunked loss (``labkit.transformer.loss``) holds one chunk's fp32 logits (and their
        bf16 original when the matmuls run in bf16) in the forward pass, and again in the backward
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
        done = 0 if self.lora else self._head_grad_elements() * self.bytes.weights
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
        head_grads = self._head_grad_elements() * stream if self.last and not self.lora else 0
        worst, worst_reduce = None, None
        for i in reversed(range(len(self.layers))):
            grads = (self._grads_in_backward(range(i + 1, len(self.layers))) if self.zero else
                     [Tensor("gradients of the layers done", "grads", self.wdt,
                             self._done(sum(self.block_trained[i + 1:]) * stream + head_grads))])
            this_block = self._this_block_in_backward(i)
            kept = always + self._kept_up_to(saved, i) + grads + this_block + [
                self._recomputed(i, saved, full, unit_start)]
            # by w_down's gradient the MLP output norm (Gemma, OLMo 2) has freed what it kept
            dropped = [self._drop_mlp_post_norm(terms, i) for terms in (saved, full)]
            base = (always + self._kept_up_to(dropped[0], i) + grads + this_block + [
                self._recomputed(i, *dropped, unit_start)] if c.post_norms else kept)
            tensors = base + [
                Tensor("first gradient of this layer (MLP down projection)", "grads", self.wdt,
                       self._first_grad(self.moe[i])),
                Tensor("activation gradients in flight", "other", self.cdt,
                       self._layer_backward_transient(self.moe[i]) + self.N * c.hidden * stream)]
            # with ep, a block's experts' bucket (stage 1: the stage's) is made by their weight
            # gradients, first in its backward after the shared experts: all it kept still there
            experts = self._experts_bucket(i, range(i + 1, len(self.layers)))
            # Gemma's and OLMo 2's layers: the backward starts in the MLP output's RMSNorm. Its
            # backward, its input from a linear, peaks 4 fp32 (N, hidden) above what it kept
            # (measured alone; 4.5 for a LLaMA-style norm in bf16)
            wide = self.N * c.hidden // (self.L.tp if self.L.sp else 1)
            temporaries = 4 * 4 * wide + (2 * wide if c.norm_style == "llama" and
                                          self.bytes.weights == 2 else 0)
            post_norm = [kept + [
                Tensor("MLP output RMSNorm's backward temporaries", "other", "fp32", temporaries),
                Tensor("gradient of the residual stream", "other", self.wdt, wide * stream)]
            ] if c.post_norms else []
            for candidate in ([tensors] + ([kept + experts] if experts else []) + post_norm
                              + self._layer_step_moment(base, i)):
                if worst is None or _total(candidate) > _total(worst[1]):
                    worst = (i, candidate)
            if self.zero >= 2:         # the block's backward is done: its bucket reduce-scattered
                reduce = always + self._kept_up_to(saved, i - 1) + grads + this_block + experts + [
                    self._reduced_shard(self.block_units[i]),
                    self._staging(self.block_units[i], self.bytes.grads),
                    Tensor("gradient of the residual stream", "other", self.wdt,
                           self.N * c.hidden * stream)]
                if worst_reduce is None or _total(reduce) > _total(worst_reduce[1]):
                    worst_reduce = (i, reduce)
        out = {f"backward: layer {self.layers[worst[0]]}": ("backward", worst[1])}
        if worst_reduce:
            out[f"backward: reduce-scatter of layer {self.layers[worst_reduce[0]]}"] = (
                "backward", worst_reduce[1])
        return out

    def _head_grad_elements(self) -> int:
        """Elements of the gradients the LM head's backward makes: its own and the final norm's;
        with tied embeddings the one weight's, the embedding's too (whole from then on)."""
        tied = embedding_weights(self.c) if self.c.tie_embeddings and self.first else []
        return sum(w.local(self.L.tp) for w in head_weights(self.c) + tied)

    @staticmethod
    def _drop_mlp_post_norm(per_layer: list, i: int) -> list:
        """``per_layer`` (each layer's ``Saved``) with layer i's MLP output norm freed."""
        return [Saved(t for t in terms if t.name != MLP_POST_NORM) if j == i else terms
                for j, terms in enumerate(per_layer)]

    def _experts_bucket(self, i: int, blocks_done) -> list[Tensor]:
        """The bucket block i's routed experts fill in its backward under ZeRO with ep: from
        stage 2 the block's own; at stage 1 the stage's, made in the first MoE block reached."""
        if not self.moe[i] or self.L.expert_ranks == 1 or not self.zero:
            return []
        if self.zero >= 2:
            return [self._bucket("this block's experts", self.block_units[i][1:])]
        first = self.L.micro_batch_count == 1 and not any(self.moe[j] for j in blocks_done)
        return self._buckets(1) if first else []

    def _recomputed(self, i: int, saved, full, unit_start) -> Tensor:
        """What recomputation has rebuilt by layer i's backward: the layers of its unit from the
        unit's first to i, less what they keep anyway (the unit's input: the first norm's fp32
        input itself when the stream is fp32)."""
        a, B, T = unit_start[i], self.B, self.T
        rebuilt = (sum(f.bytes(B, T) for f in full[a:i + 1])
                   - sum(s.bytes(B, T) for s in saved[a:i + 1]))
        if not self.c.pre_norms and self.mixed and self.kept[a] != "none":
            # OLMo's linears keep bf16 copies of a unit's input, not the fp32 input it holds
            rebuilt += sum(t.bytes(B, T) for t in saved[a] if t.name.startswith("block input"))
        return Tensor("recomputed activations", "other", self.cdt, rebuilt)

    def _naive_attention_moment(self, always, saved, full, unit_start) -> dict:
        """Naive attention's backward in each layer (``naive.naive_backward_alive``): the
        layers below keep their tensors (those recomputed with it rebuilt), this layer's MLP,
        output projection and norm have their gradients, and two (B, H, T, T) gradients form."""
        if self.recipe.attention != "naive" or self.lora:
            return {}
        c, B, T, L, stream = self.c, self.B, self.T, self.L, self.bytes.weights
        alive = naive_backward_alive(c, self.recipe.precision, L.tp, L.sp)
        head_grads = self._head_grad_elements() * stream if self.last else 0
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
                                        + sum(w.local(L.tp, L.expert_ranks) for w in done))))])
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
        if m == 1 or (self.L.virtual_stages > 1 and flight == m):
            return {}
        if self.zero:        # ZeRO's buckets or shards stand in the ordinary moments already
            return self._weight_gradient_moment(always, saved, label, self._grads_in_backward(
                range(len(self.layers))), flight) if self.split else {}
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
                new = 0 if self.lora else self.c.vocab_size * self.c.hidden * self.bytes.weights
                out["backward: LM head, a later micro-batch"] = ("backward", alive + [
                    grads, Tensor("logits gradient", "other", "fp32", 4 * logits),
                    Tensor("the LM head's new gradient, before it is added", "other", self.wdt,
                           new),
                    Tensor("gradient of the LM head's input", "other", self.cdt,
                           wide * compute_bytes(self.recipe.precision))])
        # the embedding's backward forms a whole new (V, h) gradient (LoRA: frozen, none)
        if self.first and not self.lora:
            others = later - Fraction(1, self.L.chunks)     # this one's chunk 0 is done
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
        if self.split:
            # stage s runs its W's late: their output gradients are alive at every later moment
            for _, tensors in out.values():
                tensors.append(self._kept_for_w(self._pending_w(at_w=False)))
            # ... and at a W, beside the micro-batches in flight, whole
            out.update(self._weight_gradient_moment(always, saved, label, [grads], flight))
        return out

    @property
    def split(self) -> bool:                   # B and W apart: ZB-H1, ZB-V, DualPipeV
        return self.L.schedule in SPLIT_BACKWARD

    def _pending_w(self, at_w: bool) -> Fraction:
        """Micro-batches whose W is pending here (``schedules.pending_w``): at a W, or at any
        other moment (one chunk fewer; ZB-H1: min(s, m))."""
        L = self.L
        at = schedules.pending_w(self.stage, L.pp, L.micro_batch_count, L.schedule)
        if at_w:
            return at
        if L.schedule == "zb-h1":
            return Fraction(min(self.stage, L.micro_batch_count))
        return max(Fraction(0), at - Fraction(1, L.chunks))

    def _kept_for_w(self, pending) -> Tensor:
        """ZB-H1's split backward (B) leaves the gradient of each weight's output until W forms
        the weights' gradients from it: ``pending`` micro-batches' of them (LoRA: only the
        adapted linears' outputs, the rest is frozen)."""
        width = {True: 0, False: 0}                 # per token: matmul outputs, other outputs
        for w in self.targets if self.lora else self.weights:
            width[w.matmul] += w.out_width(self.L.tp)
        per_micro_batch = self.N * (width[True] * compute_bytes(self.recipe.precision)
                                    + width[False] * self.bytes.weights)
        return Tensor(f"output gradients kept for W ({pending} micro-batches)", "other",
                      self.cdt, int(pending * per_micro_batch))

    def _weight_gradient_moment(self, always, saved, label: str, grads: list[Tensor],
                                flight) -> dict:
        """ZB-H1's W of a later micro-batch: it keeps the micro-batch's saved tensors (the graph)
        until then. Stage s defers s W's: s + 1 micro-batches' output gradients alive at a W,
        beside the ``flight`` micro-batches in flight, whole."""
        pending = self._pending_w(at_w=True)
        largest = max(w.local(self.L.tp, self.L.expert_ranks) for w in self.trained) * self.bytes.grads
        kept = self.tensors_of(saved, flight, label) + self._sent_outputs(flight)
        name = "backward: weight gradients (W), a later micro-batch"
        return {name: ("backward", always + kept + grads + [
            self._kept_for_w(pending),
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
            largest = max(w.local(self.L.tp) for w in lora_targets(c, self.moe[i]))
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
        fsdp = ([self._gathered("this block", self.gathered_units[i]), *self._prefetched(i)]
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
        # a tied weight: the LM head's share of its gradient waits in autograd's buffer until
        # the embedding's is made, then the two are summed into a third tensor
        tied = embedding_grad if c.tie_embeddings and self.last else 0
        residual = Tensor("gradient of the residual stream", "other", self.wdt,
                          0 if self.lora else self.N * c.hidden * stream)
        grads = (self._grads_in_backward(range(len(self.layers))) if self.zero else
                 [Tensor("every other gradient", "grads", self.wdt,
                         self._done(self.n_train * self.bytes.grads - embedding_grad))])
        out = {"backward: embedding": ("backward", always + grads + [
            Tensor("embedding gradient being formed", "other", self.wdt, embedding_grad),
            Tensor("the LM head's share of the tied weight's gradient, and their sum", "other",
                   self.wdt, (1 if self.policy else 2) * tied),   # FSDP2: the head's share held
            residual])}
        out.update(self._embedding_step_moment(always, embedding_grad))
        if self.zero >= 2 and self.rest:    # the last unit done: the root's bucket reduced
            out["backward: reduce-scatter of the embedding, final norm and LM head"] = (
                "backward", always + grads + [self._reduced_shard(self.rest),
                                              self._staging(self.rest, self.bytes.grads)])
        if self.policy and self.rest:       # FSDP2: the root's bf16 gradients cast to fp32
            out.update(self._fsdp2_root_moment(always))
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
        if self.in_backward:
            return self._largest_step_moment(always, temporaries)
        return {"optimizer step": ("optimizer", always + [
            Tensor("gradients", "grads", self.wdt,
                   0 if self.master or self.in_buckets else self.grads()),
            Tensor("fp32 copies of the gradients", "other", "fp32",
                   self.n_train * 4 if self.master else 0),
            temporaries])}
