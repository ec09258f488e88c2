"""Lab 03's panel: a checkpointing policy's memory and recompute cost."""
from __future__ import annotations

import ipywidgets as w

from labkit.core.config import preset
from labkit.core.recompute import RECOMPUTE_POLICIES
from labkit.course.panel_reports import RecomputeResult, recompute_report
from labkit.course.plot import breakdown_figure
from labkit.course.widgets.base import _render


class RecomputePanel:
    """Layers, sequence, batch and policy -> saved activations, peak and recompute FLOPs."""

    def __init__(self, model: str = "small", seq: int = 1024, precision: str = "bf16-mixed"):
        self.model, self.precision = model, precision
        self.layers = w.IntSlider(value=preset(model).layers, min=1, max=64, description="layers")
        self.seq = w.IntSlider(value=seq, min=128, max=16384, step=128, description="seq")
        self.batch = w.BoundedIntText(value=1, min=1, max=256, description="batch",
                                      layout=w.Layout(width="190px"))
        self.policy = w.Dropdown(options=RECOMPUTE_POLICIES, value="full", description="policy")
        self.output = w.Output()
        self.result: RecomputeResult | None = None
        for control in (self.layers, self.seq, self.batch, self.policy):
            control.observe(lambda _: self.update(), names="value")
        self.widget = w.VBox([w.HBox([self.policy, self.layers]), w.HBox([self.seq, self.batch]),
                              self.output])
        self.update()

    def update(self) -> RecomputeResult:
        from labkit.transformer.checkpointing import recompute_cost
        values = dict(layers=self.layers.value, seq=self.seq.value, batch=self.batch.value)
        result = recompute_report(self.model, policy=self.policy.value,
                                  precision=self.precision, **values)
        self.result = result
        if result.error:
            _render(self.output, result.summary())
            return result
        # the FLOPs counted on fake tensors (torch): the measuring side, here only
        result.extra_flops = recompute_cost(result.config, self.policy.value,
                                            seq=min(values["seq"], 1024), batch=1).extra
        _render(self.output, result.summary(), breakdown_figure(result.bars(), title=result.bars_title()))
        return result


def recompute_panel(**defaults) -> w.VBox:
    """The recompute panel of lab 03 (``RecomputePanel`` holds its state and callbacks)."""
    return RecomputePanel(**defaults).widget
