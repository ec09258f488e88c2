"""The memory panel (labs 00 and 02): a model and a step, the predicted breakdown; a button
measures the same step."""
from __future__ import annotations

import ipywidgets as w

from labkit.core.config import preset, presets
from labkit.core.recipe import OPTIMIZERS, PRECISIONS
from labkit.course.plot import breakdown_figure, timeline_figure
from labkit.course.panel_reports import PanelResult, SHAPE_FIELDS, predict, preset_shape
from labkit.course.widgets.base import _render
from labkit.training.measure import measure_step


def predict_and_measure(name: str, *, batch: int, seq: int, precision: str, optimizer: str,
                        **shape) -> PanelResult:
    """``predict``, then one step of the same model measured on fake tensors."""
    result = predict(name, batch=batch, seq=seq, precision=precision, optimizer=optimizer, **shape)
    if result.error:
        return result
    try:
        cfg = result.config.replace(max_seq=max(result.config.max_seq, seq))
        result.measurement = measure_step(cfg, batch=batch, seq=seq, precision=precision,
                                          optimizer=optimizer, fake=True)
    except ValueError as error:
        result.error = str(error)
    return result


class MemoryPanel:
    """Controls -> predicted breakdown at once; the button adds the fake-tensor measurement."""

    def __init__(self, model: str = "llama-2-7b", seq: int = 2048, batch: int = 1,
                 precision: str = "bf16-mixed", optimizer: str = "adamw"):
        cfg = preset(model)
        self.model = w.Dropdown(options=presets(), value=model, description="model")
        self.shape = {f: w.BoundedIntText(value=getattr(cfg, f), min=1, max=10**7,
                                          description=f.replace("_size", ""),
                                          layout=w.Layout(width="190px"))
                      for f in SHAPE_FIELDS}
        self.seq = w.IntSlider(value=seq, min=128, max=32768, step=128, description="seq")
        self.batch = w.BoundedIntText(value=batch, min=1, max=4096, description="batch",
                                      layout=w.Layout(width="190px"))
        self.precision = w.Dropdown(options=PRECISIONS, value=precision, description="precision")
        self.optimizer = w.Dropdown(options=OPTIMIZERS, value=optimizer, description="optimizer")
        self.button = w.Button(description="measure on fake tensors", icon="play",
                               layout=w.Layout(width="220px"))
        self.status = w.HTML()
        self.output = w.Output()
        self.result: PanelResult | None = None
        self._syncing = False
        self.model.observe(self._on_model, names="value")
        for control in (*self.shape.values(), self.seq, self.batch, self.precision,
                        self.optimizer):
            control.observe(lambda _: self._syncing or self.update(), names="value")
        self.button.on_click(lambda _: self.measure())
        self.widget = w.VBox([
            w.HBox([self.model, self.precision, self.optimizer]),
            w.HBox(list(self.shape.values())),
            w.HBox([self.seq, self.batch, self.button]),
            self.status, self.output])
        self.update()

    def values(self) -> dict:
        return dict(batch=self.batch.value, seq=self.seq.value, precision=self.precision.value,
                    optimizer=self.optimizer.value,
                    **{f: c.value for f, c in self.shape.items()})

    def _on_model(self, change):
        shape = preset_shape(change["new"])
        self._syncing = True                       # one update for the whole new shape
        for field, control in self.shape.items():
            control.value = shape[field]
        self._syncing = False
        self.update()

    def _show(self, result: PanelResult):
        self.result = result
        self.status.value = "<br>".join(result.summary().splitlines())
        if result.error:
            _render(self.output)
            return
        _render(self.output, breakdown_figure(result.bars(), title=result.bars_title()),
                *([timeline_figure(result.measurement)] if result.measurement is not None else []))

    def update(self) -> PanelResult:
        self._show(predict(self.model.value, **self.values()))
        return self.result

    def measure(self) -> PanelResult:
        self.status.value = "measuring one training step on fake tensors…"
        self.button.disabled = True
        try:
            self._show(predict_and_measure(self.model.value, **self.values()))
        finally:
            self.button.disabled = False
        return self.result


def memory_panel(**defaults) -> w.VBox:
    """The memory panel of labs 00 and 02 (``MemoryPanel`` holds its state and callbacks)."""
    return MemoryPanel(**defaults).widget
