"""Lab 01's panel: bytes per parameter of each model state, sharded by ZeRO."""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import ipywidgets as w

from labkit.core.config import preset, presets
from labkit.core.recipe import OPTIMIZERS, PRECISIONS, Layout, state_bytes
from labkit.core.units import fmt_bytes
from labkit.course.plot import breakdown_figure
from labkit.course.widgets.base import PanelResult, _render
from labkit.parallel.data import zero
from labkit.predict import Estimate, estimate


# each state's field in ``core.recipe.StateBytes`` -> its name in ``parallel.data.zero``, its label
STATES = {"weights": ("params", "weights"), "grads": ("grads", "gradients"),
          "optimizer": ("optimizer", "optimizer state")}


@dataclass
class StatesResult(PanelResult):
    """The states panel's result: per state, (bytes per parameter, GPUs it is split over), and
    the estimate per GPU beside the same step on one GPU without ZeRO."""

    per_parameter: dict | None = None
    unsharded: Estimate | None = None
    layout: Layout | None = None
    batch: int = 1
    seq: int = 2048

    def per_gpu(self, state: str) -> Fraction:
        """Bytes per parameter of ``state`` that one GPU holds."""
        return Fraction(*self.per_parameter[state])

    def summary(self) -> str:
        if self.error:
            return f"⚠ {self.error}"
        L, e, one = self.layout, self.estimate, self.unsharded
        terms = " + ".join(f"{label} {b}" + (f"/{n}" if n > 1 else "")
                           for state, (_, label) in STATES.items()
                           for b, n in [self.per_parameter[state]])
        states = sum(self.per_gpu(s) for s in STATES)
        cache = self.per_parameter["weight cache"][0]
        return "\n".join([
            f"{self.config.name}, {self.recipe}, ZeRO-{L.zero_stage} over {L.dp} GPU"
            f"{'s' if L.dp > 1 else ''}. Bytes per parameter on one GPU:",
            f"  {terms} = {float(states):g} (one GPU without ZeRO: "
            f"{sum(b for b, _ in (self.per_parameter[s] for s in STATES))})"
            + (f"; autocast's bf16 weight copies {cache} per matmul weight, not sharded"
               if cache else ""),
            f"model states per GPU: {fmt_bytes(_states(e))} "
            f"(one GPU without ZeRO: {fmt_bytes(_states(one))})",
            f"peak of one step per GPU, batch {self.batch} x {self.seq} tokens, CUDA defaults: "
            f"{fmt_bytes(e.total)} during {e.peak_phase} (one GPU: {fmt_bytes(one.total)})"])


def _states(e: Estimate) -> int:
    return sum(e.details["model states"].values())


def states_report(model: str, *, precision: str, optimizer: str, zero_stage: int, gpus: int,
                  seq: int = 2048, batch: int = 1) -> StatesResult:
    """Bytes per parameter of each state with ZeRO ``zero_stage`` over ``gpus`` data-parallel
    GPUs (``core.recipe.state_bytes`` split as ``parallel.data.zero`` splits it), and the
    step's estimate per GPU (CUDA defaults) beside one GPU without ZeRO; an impossible setting
    is explained."""
    try:
        cfg = preset(model)
        layout = Layout(dp=gpus, zero_stage=zero_stage)
        b = state_bytes(precision, optimizer)
        split = {state: (getattr(b, state),
                         gpus if zero_stage >= zero.SHARDED_FROM_STAGE[name] else 1)
                 for state, (name, _) in STATES.items()}
        split["weight cache"] = (b.weight_cache, 1)
        step = dict(batch=batch, seq=seq, precision=precision, optimizer=optimizer, device="cuda")
        return StatesResult(cfg, estimate(cfg, layout=layout, **step), per_parameter=split,
                            unsharded=estimate(cfg, **step), layout=layout, batch=batch,
                            seq=seq, recipe=f"{precision} {optimizer}")
    except ValueError as error:
        return StatesResult(error=str(error))


class StatesPanel:
    """Model, precision, optimizer, ZeRO stage and GPUs -> bytes per parameter of each state
    and the per-GPU breakdown of one step."""

    def __init__(self, model: str = "llama-2-7b", precision: str = "bf16-master",
                 optimizer: str = "adamw", zero_stage: int = 0, gpus: int = 8, seq: int = 2048):
        wide = {"style": {"description_width": "initial"}}
        self.seq = seq
        self.model = w.Dropdown(options=presets(), value=model, description="model")
        self.precision = w.Dropdown(options=PRECISIONS, value=precision, description="precision")
        self.optimizer = w.Dropdown(options=OPTIMIZERS, value=optimizer, description="optimizer")
        self.zero_stage = w.IntSlider(value=zero_stage, min=0, max=3, description="ZeRO stage",
                                      **wide)
        self.gpus = w.IntSlider(value=gpus, min=1, max=64, description="GPUs", **wide)
        self.output = w.Output()
        self.result: StatesResult | None = None
        for control in (self.model, self.precision, self.optimizer, self.zero_stage, self.gpus):
            control.observe(lambda _: self.update(), names="value")
        self.widget = w.VBox([w.HBox([self.model, self.precision, self.optimizer]),
                              w.HBox([self.zero_stage, self.gpus]), self.output])
        self.update()

    def update(self) -> StatesResult:
        result = states_report(self.model.value, precision=self.precision.value,
                               optimizer=self.optimizer.value, zero_stage=self.zero_stage.value,
                               gpus=self.gpus.value, seq=self.seq)
        self.result = result
        if result.error:
            _render(self.output, result.summary())
            return result
        L = result.layout
        _render(self.output, result.summary(), breakdown_figure(
            {"one GPU, no ZeRO": result.unsharded,
             f"ZeRO-{L.zero_stage}, {L.dp} GPUs: each": result.estimate},
            title=f"{result.config.name}: one step's peak per GPU, batch {result.batch} x "
                  f"{result.seq} tokens"))
        return result


def states_panel(**defaults) -> w.VBox:
    """The model-states panel of lab 01 (``StatesPanel`` holds its state and callbacks)."""
    return StatesPanel(**defaults).widget
