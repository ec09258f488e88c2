"""The moments of a step whose optimizer runs inside backward (``Recipe.optimizer_in_backward``,
``labkit.training.in_backward``): a mixin of ``step._Step``. Each weight is updated by a hook
once its gradient is made, then the gradient is freed: no gradient of a finished layer is kept,
and each update's temporaries join the moment its gradient is made."""
from __future__ import annotations

from labkit.core.recipe import compute_bytes
from labkit.predict.terms import Tensor


class InBackwardMoments:
    """The updates' moments in the backward pass."""

    def _stepping(self, numel: int) -> Tensor:
        """With the optimizer in backward: the step temporaries of the weight whose gradient was
        just made (nothing otherwise)."""
        return Tensor("that weight's optimizer step, in backward", "other",
                      self.wdt, self.step_temporaries(numel) if self.in_backward else 0)

    def _layer_step_moment(self, base: list[Tensor], i: int) -> list[list[Tensor]]:
        """With the optimizer in backward, a block's first update: its MLP down projection's
        backward done, that weight's gradient made and stepped, the gradients of its input and
        of the residual stream in flight (the layer's wider transients come later)."""
        if not self.in_backward:
            return []
        c, moe, cb = self.c, self.moe[i], compute_bytes(self.recipe.precision)
        width = (max(1, c.shared_experts) * c.moe_ffn if moe else c.ffn) // self.L.tp
        first = self._first_grad(moe)
        return [base + [
            Tensor("first gradient of this layer (MLP down projection)", "grads", self.wdt, first),
            self._stepping(first // self.bytes.grads),
            Tensor("gradient of the down projection's input", "other", self.cdt, self.N * width * cb),
            Tensor("gradient of the residual stream", "other", self.wdt,
                   self.N * c.hidden * self.bytes.weights)]]

    def _head_step_moment(self, kept: list[Tensor], head: list[Tensor]) -> dict:
        """With the optimizer in backward, the LM head's update: its backward is done (the loss's
        tensors and its input freed), its gradient made, the gradient of its input in flight."""
        if not (self.in_backward and self.last) or self.lora or self.c.tie_embeddings:
            return {}
        numel = self.c.vocab_size * self.c.hidden // self.L.tp
        norm = [t for t in head if t.name == "final RMSNorm"]
        done = kept + norm + [
            Tensor("gradient of the LM head's input", "other", self.cdt,
                   self.N * self.c.hidden // (self.L.tp if self.L.sp else 1)
                   * compute_bytes(self.recipe.precision)),
            Tensor("LM head gradient", "grads", self.wdt, numel * self.bytes.grads)]
        out = {"backward: the LM head's optimizer step": ("backward", done + [self._stepping(numel)])}
        if self.recipe.loss_chunk:      # formed chunk by chunk: the chunked loss's own moments
            return out
        if self.mixed:      # autocast: the bf16 gradient of its bf16 copy, cast to the fp32 one
            out["backward: the LM head's gradient cast to fp32"] = ("backward", done + [
                Tensor("LM head gradient in bf16 (autocast)", "other", "bf16", numel * 2)])
        else:               # its matmul's backward: the logits' gradient and its input still there
            saved_input = [t for t in head if t.name == "input of the LM head"]
            out["backward: the LM head's gradient formed"] = ("backward", done + saved_input + [
                Tensor("logits gradient", "other", self.cdt,
                       self.N * self.c.vocab_size // self.L.tp
                       * compute_bytes(self.recipe.precision))])
        return out

    def _embedding_step_moment(self, always, embedding_grad: int) -> dict:
        """The embedding's update, last in backward: its gradient (a tied weight's summed one)
        made, every other gradient already stepped and freed."""
        if not (self.in_backward and embedding_grad):
            return {}
        return {"backward: the embedding's optimizer step": ("backward", always + [
            Tensor("embedding gradient", "grads", self.wdt, embedding_grad),
            self._stepping(embedding_grad // self.bytes.grads)])}

    def _largest_step_moment(self, always, temporaries: Tensor) -> dict:
        """No optimizer phase: the largest weight's update, with the states alone around it."""
        largest = max(self._stepped_sizes(), default=0) * self.bytes.grads
        return {"backward: a weight's optimizer step (the largest)": ("backward", always + [
            Tensor("the largest weight's gradient", "grads", self.wdt, largest), temporaries])}
