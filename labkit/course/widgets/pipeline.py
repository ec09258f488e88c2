"""Lab 05's panel: tp, pp, micro-batches and schedule -> each stage's memory and a Gantt chart."""
from __future__ import annotations

import ipywidgets as w

from labkit.core.config import preset, presets
from labkit.course.panel_reports import (INTERLEAVED_CHUNKS, MAX_MICRO_BATCHES, MAX_PP,
                                         PANEL_SCHEDULES, PIPELINE_SEQS, PipelineResult,
                                         pipeline_controls, pipeline_report, tp_choices)
from labkit.course.plot import gantt_figure, stage_peaks_figure
from labkit.course.widgets.base import _render
from labkit.course.widgets.zero import COURSE_MODELS


class PipelinePanel:
    """Model, tp, sp, pp, micro-batches, schedule and seq -> each stage's peak per GPU, the
    schedule's Gantt chart and its idle fraction beside the paper's formula. ``pp`` None: half
    the layers, at most 4 (room on the slider, and interleaving possible)."""

    def __init__(self, model: str = "llama-2-7b", tp: int = 2, pp: int | None = None,
                 micro_batches: int = 8, schedule: str = "1f1b", sp: bool = False,
                 seq: int = 2048):
        pp = pp or max(1, min(4, preset(model).layers // INTERLEAVED_CHUNKS))
        if tp not in tp_choices(model):
            raise ValueError(f"tp={tp!r}: choose one of {tp_choices(model)} for {model}")
        wide = {"style": {"description_width": "initial"}}
        self.model = w.Dropdown(options=[*COURSE_MODELS,
                                         *(p for p in presets() if p not in COURSE_MODELS)],
                                value=model, description="model")
        self.tp = w.Dropdown(options=tp_choices(model), value=tp, description="tp")
        self.sp = w.Checkbox(value=sp, description="sequence parallel (needs tp > 1)", **wide)
        self.pp = w.IntSlider(value=pp, min=1, max=min(preset(model).layers, MAX_PP),
                              description="pp")
        self.micro_batches = w.IntSlider(value=micro_batches, min=1, max=MAX_MICRO_BATCHES,
                                         description="micro-batches", **wide)
        self.schedule = w.Dropdown(options=PANEL_SCHEDULES, value=schedule,
                                   description="schedule")
        self.seq = w.Dropdown(options=PIPELINE_SEQS, value=seq, description="seq")
        self.output = w.Output()
        self.result: PipelineResult | None = None
        self._syncing = False
        self.model.observe(self._on_model, names="value")
        for control in (self.tp, self.sp, self.pp, self.micro_batches, self.schedule, self.seq):
            control.observe(lambda _: self._syncing or self.update(), names="value")
        self.widget = w.VBox([w.HBox([self.model, self.schedule, self.seq]),
                              w.HBox([self.tp, self.sp]), w.HBox([self.pp, self.micro_batches]),
                              self.output])
        self.update()

    def _on_model(self, change):
        controls = pipeline_controls(change["new"], self.tp.value)
        self._syncing = True                     # one update for the new model's controls
        self.tp.options = controls["tp_options"]
        self.tp.value = controls["tp"]
        self.pp.max = controls["pp_max"]                          # the slider clamps pp
        self._syncing = False
        self.update()

    def update(self) -> PipelineResult:
        result = pipeline_report(self.model.value, tp=self.tp.value, pp=self.pp.value,
                                 micro_batches=self.micro_batches.value,
                                 schedule=self.schedule.value, sp=self.sp.value,
                                 seq=self.seq.value)
        self.result = result
        if result.error:
            _render(self.output, result.summary())
            return result
        bars = stage_peaks_figure(result.shown_stages(), title=result.bars_title())
        gantt = [gantt_figure(result.timeline)] if result.gantt_drawn else []
        _render(self.output, result.summary(), bars, *gantt)       # the summary says if none
        return result


def pipeline_panel(**defaults) -> w.VBox:
    """The pipeline panel of lab 05 (``PipelinePanel`` holds its state and callbacks)."""
    return PipelinePanel(**defaults).widget
