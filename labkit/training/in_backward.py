"""The optimizer step inside the backward pass: each parameter is updated as soon as its gradient
is made, and the gradient freed, so that a step never holds every gradient at once.

The mechanism is PyTorch's ``Tensor.register_post_accumulate_grad_hook`` (its tutorial "How to
save memory by fusing the optimizer step into the backward pass"), as torchtune's
``optimizer_in_bwd`` runs it: one optimizer per parameter, stepped by the parameter's hook.
"""
from __future__ import annotations

import torch


class OptimizerInBackward:
    """One optimizer per trained parameter, each stepped by the parameter's
    post-accumulate-grad hook, which then frees the gradient. ``step`` updates only
    parameters whose gradients are still there (none after a backward pass)."""

    def __init__(self, params, make_inner):
        self.params = [p for p in params if p.requires_grad]     # a frozen weight needs none
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("a parameter is listed twice; pass each once (model.parameters() "
                             "lists a tied weight once)")
        self.per_param = {p: make_inner([p]) for p in self.params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._step_one)
                       for p in self.params]

    def _step_one(self, param: torch.Tensor) -> None:
        """The hook: this parameter's update, then its gradient freed."""
        optimizer = self.per_param[param]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @property
    def state(self) -> dict:
        """Every parameter's optimizer state, as one optimizer's ``state``."""
        return {p: s for opt in self.per_param.values() for p, s in opt.state.items()}

    @property
    def param_groups(self) -> list[dict]:
        """Every per-parameter optimizer's groups (a learning-rate schedule sets each)."""
        return [g for opt in self.per_param.values() for g in opt.param_groups]

    def step(self) -> None:
        """Update the parameters whose gradients were set outside a backward pass."""
        for p in self.params:
            if p.grad is not None:
                self._step_one(p)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def memory_tags(self) -> list:
        """What the per-parameter optimizers tag for the tracker themselves (AdamW8bit)."""
        return [t for opt in self.per_param.values()
                for t in getattr(opt, "memory_tags", list)()]

    def remove(self) -> None:
        """Take the hooks off: the parameters train with an ordinary optimizer again."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
