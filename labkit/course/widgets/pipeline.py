"""Lab 05's panel: tp, pp, micro-batches and schedule -> each stage's memory and a Gantt chart."""
from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as w

from labkit.core.config import preset, presets
from labkit.core.recipe import Layout
from labkit.core.units import fmt_bytes
from labkit.course.plot import gantt_figure, stage_peaks_figure
from labkit.course.widgets.base import PanelResult, _render
from labkit.course.widgets.zero import COURSE_MODELS
from labkit.parallel.pipeline import pipeline_parallel as pipeline, schedules
from labkit.predict import estimate
from labkit.predict.papers import pipeline_bubble


PIPELINE_SEQS = (512, 1024, 2048, 4096, 8192)
MAX_PP = 16                       # the pp slider's end (fewer when the model has fewer layers)
MAX_MICRO_BATCHES = 32
GANTT_MAX = 256                   # p x m above which the Gantt chart is too dense to read
SHOWN_STAGES = 8                  # more stages: the bars show the first, the middle and the last
INTERLEAVED_CHUNKS = 2            # virtual stages per GPU under the interleaved schedule
MICRO_BATCH = 1                   # sequences per micro-batch: estimate's batch under pp (x m)
BUBBLE_FORMULAS = {"gpipe": "(p-1)/(m+p-1)", "1f1b": "(p-1)/(m+p-1)",
                   "interleaved": "(p-1)/(v m+p-1)", "zb-h1": "(p-1)/(3m+p-1)"}


def tp_choices(model: str) -> list[int]:
    """The tensor-parallel degrees the panel offers: the divisors of the model's heads up to 8."""
    return [t for t in range(1, 9) if preset(model).heads % t == 0]


@dataclass
class PipelineResult(PanelResult):
    """The pipeline panel's result: the busiest stage's estimate (every stage's peak in
    ``.stages``), the simulated schedule, its formula's idle fraction, micro-batches in flight."""

    layout: Layout | None = None
    seq: int = 2048
    timeline: schedules.PipelineTimeline | None = None
    bubble: float = 0.0                   # the paper's formula (papers.pipeline_bubble)
    in_flight: list | None = None         # per stage, micro-batches whose activations it keeps

    @property
    def stages(self) -> list[dict]:
        """Each stage's total, saved activations and peak moment (one stage when pp = 1)."""
        e = self.estimate
        one = dict(total=e.total, saved_activations=e.saved_activations,
                   peak_moment=e.details["peak moment"])
        return e.details.get("stages", [one])

    def summary(self) -> str:
        if self.error:
            return f"⚠ {self.error}"
        L, e, t = self.layout, self.estimate, self.timeline
        m, v = L.micro_batch_count, L.virtual_stages
        busiest = max(range(L.pp), key=lambda s: self.stages[s]["total"])
        flight = ", ".join(f"{float(f):g}" for f in self.in_flight)
        caveat = " (it assumes m >= p)" if L.schedule == "zb-h1" and m < L.pp else ""
        chunks = f" (v={v} chunks per GPU)" if v > 1 else ""
        rows = MICRO_BATCH * m
        return "\n".join([
            f"{self.config.name}, tp={L.tp}{' with sp' if L.sp else ''} x pp={L.pp} = "
            f"{L.tp * L.pp} GPUs, {L.schedule}{chunks}; batch = micro-batch size {MICRO_BATCH} "
            f"x m = {rows} sequence{'s' if rows > 1 else ''} of {self.seq} tokens",
            f"CUDA defaults, bf16 with fp32 master weights (AdamW): peak per GPU "
            f"{fmt_bytes(e.total)} on stage {busiest} (at '{e.details['peak moment']}')",
            f"micro-batches in flight per stage: {flight}",
            f"idle (bubble) fraction: simulated {float(t.idle_fraction):.1%}, formula "
            f"{BUBBLE_FORMULAS[L.schedule]} = {self.bubble:.1%}{caveat}"])


def pipeline_report(model: str, *, tp: int, pp: int, micro_batches: int, schedule: str,
                    sp: bool = False, seq: int = 2048) -> PipelineResult:
    """Each stage's peak per GPU (CUDA defaults, bf16-master AdamW, micro-batches of one
    sequence), the schedule simulated and its idle fraction beside the paper's formula; an
    impossible setting is explained in ``.error``."""
    v = INTERLEAVED_CHUNKS if schedule == "interleaved" else 1
    try:
        cfg = preset(model)
        if v > 1 and pp * v > cfg.layers:
            raise ValueError(f"interleaved 1F1B gives each GPU {v} chunks of at least one layer: "
                             f"choose pp <= {cfg.layers // v} for {model}'s {cfg.layers} layers")
        layout = Layout(tp=tp, sp=sp, pp=pp, micro_batches=micro_batches, schedule=schedule,
                        virtual_stages=v)
        est = estimate(cfg, MICRO_BATCH, seq, precision="bf16-master", device="cuda",
                       layout=layout)           # each of the m micro-batches: MICRO_BATCH rows
        timeline = schedules.simulate(schedules.make_schedule(schedule, pp, micro_batches, v))
    except ValueError as error:
        return PipelineResult(error=str(error))
    return PipelineResult(
        cfg, est, recipe="bf16-master AdamW", layout=layout, seq=seq, timeline=timeline,
        bubble=pipeline_bubble(pp, micro_batches, schedule, v),
        in_flight=[pipeline.in_flight(s, pp, micro_batches, schedule, v) for s in range(pp)])


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
        self.schedule = w.Dropdown(options=pipeline.SCHEDULES, value=schedule,
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
        tp, choices = self.tp.value, tp_choices(change["new"])
        self._syncing = True                     # one update for the new model's controls
        self.tp.options = choices
        self.tp.value = max(t for t in choices if t <= tp)
        self.pp.max = min(preset(change["new"]).layers, MAX_PP)    # the slider clamps pp
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
        p, m = self.pp.value, self.micro_batches.value
        shown = range(p) if p <= SHOWN_STAGES else (0, p // 2, p - 1)
        bars = stage_peaks_figure(
            {f"stage {s}": result.stages[s] for s in shown},
            title=f"{result.config.name}: each stage's peak per GPU, tp={self.tp.value}, "
                  f"pp={p}, m={m} ({'first, middle and last of ' if p > SHOWN_STAGES else ''}"
                  f"{p} stage{'s' if p > 1 else ''})")
        if p * m <= GANTT_MAX:
            _render(self.output, result.summary(), bars, gantt_figure(result.timeline))
        else:
            _render(self.output, result.summary() + f"\n(the Gantt chart is drawn for p x m <= "
                    f"{GANTT_MAX}; here {p} x {m} = {p * m})", bars)
        return result


def pipeline_panel(**defaults) -> w.VBox:
    """The pipeline panel of lab 05 (``PipelinePanel`` holds its state and callbacks)."""
    return PipelinePanel(**defaults).widget
