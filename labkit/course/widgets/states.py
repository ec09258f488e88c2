"""Lab 01's panel: bytes per parameter of each model state, sharded by ZeRO."""
from __future__ import annotations

import ipywidgets as w

from labkit.core.config import presets
from labkit.core.recipe import OPTIMIZERS, PRECISIONS
from labkit.course.panel_reports import StatesResult, states_report
from labkit.course.plot import breakdown_figure
from labkit.course.widgets.base import _render


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
        _render(self.output, result.summary(), breakdown_figure(
            result.bars(), title=result.bars_title()))
        return result


def states_panel(**defaults) -> w.VBox:
    """The model-states panel of lab 01 (``StatesPanel`` holds its state and callbacks)."""
    return StatesPanel(**defaults).widget
