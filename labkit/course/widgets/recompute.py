"""Lab 03's panel: a checkpointing policy's memory and recompute cost."""
from __future__ import annotations

import ipywidgets as w

from labkit.core.config import preset
from labkit.core.units import fmt_bytes
from labkit.course.plot import breakdown_figure
from labkit.course.widgets.base import PanelResult, _render
from labkit.course.widgets.memory import predict
from labkit.predict import estimate


def recompute_report(model: str, *, layers: int, seq: int, batch: int, policy: str,
                     precision: str = "bf16-mixed") -> PanelResult:
    """Estimate of one step under ``policy`` and without, for the recompute panel."""
    result = predict(model, batch=batch, seq=seq, precision=precision, optimizer="adamw",
                     layers=layers)
    if result.error:
        return result
    try:
        result.estimate = estimate(result.config, batch=batch, seq=seq, precision=precision,
                                   recompute=policy)
    except ValueError as error:
        result.error = str(error)
    return result


class RecomputePanel:
    """Layers, sequence, batch and policy -> saved activations, peak and recompute FLOPs."""

    def __init__(self, model: str = "small", seq: int = 1024, precision: str = "bf16-mixed"):
        from labkit.transformer.checkpointing import RECOMPUTE_POLICIES
        self.model, self.precision = model, precision
        self.layers = w.IntSlider(value=preset(model).layers, min=1, max=64, description="layers")
        self.seq = w.IntSlider(value=seq, min=128, max=16384, step=128, description="seq")
        self.batch = w.BoundedIntText(value=1, min=1, max=256, description="batch",
                                      layout=w.Layout(width="190px"))
        self.policy = w.Dropdown(options=RECOMPUTE_POLICIES, value="full", description="policy")
        self.output = w.Output()
        self.result: PanelResult | None = None
        for control in (self.layers, self.seq, self.batch, self.policy):
            control.observe(lambda _: self.update(), names="value")
        self.widget = w.VBox([w.HBox([self.policy, self.layers]), w.HBox([self.seq, self.batch]),
                              self.output])
        self.update()

    def update(self) -> PanelResult:
        from labkit.transformer.checkpointing import recompute_cost
        values = dict(layers=self.layers.value, seq=self.seq.value, batch=self.batch.value)
        result = recompute_report(self.model, policy=self.policy.value,
                                  precision=self.precision, **values)
        self.result = result
        if result.error:
            _render(self.output, f"⚠ {result.error}")
            return result
        keep = estimate(result.config, batch=values["batch"], seq=values["seq"],
                        precision=self.precision)
        cost = recompute_cost(result.config, self.policy.value, seq=min(values["seq"], 1024),
                              batch=1)
        _render(self.output,
                f"saved activations {fmt_bytes(result.estimate.saved_activations)} "
                f"(keeping everything: {fmt_bytes(keep.saved_activations)}); peak "
                f"{fmt_bytes(result.estimate.total)} (vs {fmt_bytes(keep.total)}); "
                f"recompute adds {100 * cost.extra:.1f}% FLOPs",
                breakdown_figure({"keep everything": keep, self.policy.value: result.estimate}))
        return result


def recompute_panel(**defaults) -> w.VBox:
    """The recompute panel of lab 03 (``RecomputePanel`` holds its state and callbacks)."""
    return RecomputePanel(**defaults).widget
