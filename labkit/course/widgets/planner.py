"""Lab 09's panel: the layouts that fit a cluster, fastest first."""
from __future__ import annotations

import ipywidgets as w

from labkit.core.config import presets
from labkit.course.panel_reports import PLAN_GPU_COUNTS, PlanResult, plan_report
from labkit.course.plot import breakdown_figure
from labkit.course.widgets.base import _render, _wire


class PlanPanel:
    """Model, GPU type, GPU count, sequence and what trains -> the planner's fastest layouts that
    fit, each one's bytes per GPU by category, and the families rejected with their reason."""

    def __init__(self, model: str = "deepseek-v2-lite", gpu: str = "a100-80gb", gpus: int = 8,
                 seq: int = 4096, trainable: str = "all"):
        from labkit.core.gpus import GPUS
        from labkit.course.plan import TRAINABLE
        self.model = w.Dropdown(options=presets(), value=model, description="model")
        self.gpu = w.Dropdown(options=list(GPUS), value=gpu, description="GPU")
        self.gpus = w.Dropdown(options=PLAN_GPU_COUNTS, value=gpus, description="GPUs")
        self.trainable = w.Dropdown(options=TRAINABLE, value=trainable, description="trains")
        self.seq = w.IntSlider(value=seq, min=512, max=32768, step=512, description="seq",
                               continuous_update=False)
        self.result: PlanResult | None = None
        _wire(self, [[self.model, self.gpu, self.gpus], [self.trainable, self.seq]])

    def update(self) -> PlanResult:
        result = plan_report(self.model.value, gpu=self.gpu.value, gpus=self.gpus.value,
                             seq=self.seq.value, trainable=self.trainable.value)
        self.result = result
        if result.error or not result.plan.fits:
            _render(self.output, result.summary(clock=True))
        else:
            _render(self.output, result.summary(clock=True), breakdown_figure(
                result.bars(), title=result.bars_title()))
        return result


def plan_panel(**defaults) -> w.VBox:
    """The planner panel of lab 09 (``PlanPanel`` holds its state)."""
    return PlanPanel(**defaults).widget
