"""Lab 04's panel: ZeRO stage and GPUs -> each rank's memory, predicted and measured on local
processes."""
from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as w

from labkit.core.config import preset, presets
from labkit.core.recipe import Layout, state_bytes
from labkit.core.units import fmt_bytes
from labkit.course.panel_reports import PanelResult
from labkit.course.plot import breakdown_figure
from labkit.course.widgets.base import _render
from labkit.predict import Estimate, estimate


COURSE_MODELS = ("tiny", "small", "tiny-moe")     # small enough to train on local processes
ZERO_PRECISIONS = ("fp32", "bf16-master", "bf16-mixed")
MEASURABLE_GPUS = (2, 4)                          # gloo ranks that a laptop's cores run in seconds
GPU_COUNTS = [2 ** k for k in range(11)]          # 1, 2, 4, ..., 1024
MEASURE_STEPS = 3                                 # the last one is steady (DDP rebuilt its buckets)


def why_not_measurable(model: str, *, precision: str, zero_stage: int, gpus: int) -> str | None:
    """Why this step cannot be measured on local processes here, naming what to choose; None
    when it can."""
    from labkit.parallel.data import zero_step
    if model not in COURSE_MODELS:
        return (f"measuring trains the model on this machine's cores: choose a course model "
                f"({', '.join(COURSE_MODELS)}); {model} needs real GPUs")
    if gpus not in MEASURABLE_GPUS:
        return ("measuring runs one process per GPU on this machine's cores: choose "
                f"{' or '.join(map(str, MEASURABLE_GPUS))} GPUs")
    if zero_stage and precision not in zero_step.PRECISIONS:    # DDP (stage 0) runs each one
        return (f"labkit's ZeRO steps fp32 or bf16-master weights (bf16 weights, fp32 masters: "
                f"the ZeRO paper's mixed precision), not {precision} (autocast over fp32 "
                "weights): choose one of those, or stage 0 (DDP)")
    return None


@dataclass
class ZeroResult(PanelResult):
    """The ZeRO panel's result: the step per GPU (rank) under ``layout`` beside one GPU without
    sharding (CUDA defaults), and when measured each rank's ``RankStep`` and the estimate with
    CPU defaults (gloo) it is compared with."""

    unsharded: Estimate | None = None
    layout: Layout | None = None
    precision: str = ""
    batch: int = 1
    seq: int = 32
    measured: list | None = None
    cpu: Estimate | None = None

    @property
    def scheme(self) -> str:
        stage = self.layout.zero_stage
        if not stage:
            return "DDP" if self.layout.dp > 1 else "no sharding"
        return f"ZeRO-{stage}" + ("-Offload" if self.layout.offload else "")

    def summary(self) -> str:
        if self.error:
            return f"⚠ {self.error}"
        L, e = self.layout, self.estimate
        weight = state_bytes(self.precision).weights
        psi = e.details["parameters on this device"] * weight          # Ψ x bytes per weight
        sent = e.details.get("bytes sent per step", 0)
        where = f"{self.scheme} over {L.dp} GPUs" if L.dp > 1 else f"{self.scheme} on one GPU"
        lines = [
            f"{self.config.name}, {self.recipe}, {where}, "
            f"batch {self.batch} x {self.seq} tokens, CUDA defaults "
            f"({e.details['optimizer implementation']} AdamW, NCCL sends in place):",
            f"peak per GPU {fmt_bytes(e.total)} at '{e.details['peak moment']}' (one GPU "
            f"without sharding: {fmt_bytes(self.unsharded.total)})",
            f"each rank sends {fmt_bytes(sent)} per step = {sent / psi:.2f} Ψ x {weight} B (the "
            f"paper's {3 if L.zero_stage == 3 else 2}Ψ; a ring sends (N-1)/N = {L.dp - 1}/{L.dp}"
            " of it)" if L.dp > 1 else "one GPU sends nothing"]
        if L.offload:
            lines.append(f"in host memory per rank {fmt_bytes(e.details['host memory'])}; copied "
                         f"host <-> device per step "
                         f"{fmt_bytes(e.details['host <-> device bytes per step'])}")
        return "\n".join(lines + (self._measured_lines() if self.measured else []))

    def _measured_lines(self) -> list[str]:
        ranks, cpu = self.measured, self.cpu
        peak = max(r.peak for r in ranks)
        sent = max(sum(v for k, v in r.sent.items() if k != "host <-> device") for r in ranks)
        lines = [
            f"measured on {len(ranks)} local processes (gloo, last of {MEASURE_STEPS} steps): "
            f"peak per rank {', '.join(fmt_bytes(r.peak) for r in ranks)}",
            f"predicted with CPU defaults ({cpu.details['optimizer implementation']} AdamW, "
            f"gloo's copies of what it sends) {fmt_bytes(cpu.total)}: off by "
            f"{100 * (cpu.total - peak) / peak:+.2f}% (max over ranks)",
            f"sent per rank: measured {fmt_bytes(sent)}, predicted "
            f"{fmt_bytes(cpu.details.get('bytes sent per step', 0))}"]
        if self.layout.offload:
            lines.append(
                f"host memory: measured {fmt_bytes(max(r.host_peak for r in ranks))}, predicted "
                f"{fmt_bytes(cpu.details['host memory'])}; host <-> device per step: measured "
                f"{fmt_bytes(max(r.sent['host <-> device'] for r in ranks))}, predicted "
                f"{fmt_bytes(cpu.details['host <-> device bytes per step'])}")
        return lines


def zero_report(model: str, *, precision: str, zero_stage: int, gpus: int,
                offload: bool = False, batch: int = 1, seq: int | None = None,
                measure: bool = False) -> ZeroResult:
    """The step per GPU with ZeRO ``zero_stage`` (0: DDP) over ``gpus`` data-parallel GPUs
    (CUDA defaults) beside one GPU; ``measure`` also runs it on ``gpus`` local gloo processes
    (3-10 s). An impossible setting, or a failed run, is explained in ``.error``."""
    from labkit.parallel import cluster
    from labkit.parallel.data import ddp, zero_step
    seq = seq or (32 if model in COURSE_MODELS else 2048)     # course models: states dominate
    try:
        cfg, layout = preset(model), Layout(dp=gpus, zero_stage=zero_stage, offload=offload)
        step = dict(batch=batch, seq=seq, precision=precision)
        result = ZeroResult(cfg, estimate(cfg, **step, layout=layout, device="cuda"),
                            recipe=f"{precision} AdamW",
                            unsharded=estimate(cfg, **step, device="cuda"), layout=layout,
                            precision=precision, batch=batch, seq=seq)
        reason = measure and why_not_measurable(model, precision=precision,
                                                zero_stage=zero_stage, gpus=gpus)
        if reason:
            raise ValueError(reason)
    except ValueError as error:
        return ZeroResult(error=str(error))
    if not measure:
        return result
    result.cpu = estimate(cfg, **step, layout=layout, device="cpu")
    try:
        if zero_stage == 0:
            result.measured = cluster.run(ddp.ddp_step, gpus, model, batch, seq, MEASURE_STEPS,
                                          precision, timeout_s=120)
        else:
            result.measured = cluster.run(zero_step.zero_step, gpus, zero_stage, model, batch,
                                          seq, MEASURE_STEPS, precision, offload, timeout_s=120)
    except (cluster.RankFailed, TimeoutError) as error:     # its traceback's last line
        result.error = f"measuring failed: {str(error).strip().splitlines()[-1]}"
    return result


class ZeroPanel:
    """Model, precision, ZeRO stage, GPUs and offload -> each rank's peak, what it sends and
    holds on the host; the button measures the same step on local processes."""

    def __init__(self, model: str = "llama-2-7b", precision: str = "bf16-master",
                 zero_stage: int = 0, gpus: int = 8, offload: bool = False, batch: int = 1):
        if gpus not in GPU_COUNTS:
            raise ValueError(f"gpus={gpus!r}: the panel's slider has powers of two, {GPU_COUNTS}")
        wide = {"style": {"description_width": "initial"}}
        self.batch = batch
        self.model = w.Dropdown(options=[*COURSE_MODELS,
                                         *(p for p in presets() if p not in COURSE_MODELS)],
                                value=model, description="model")
        self.precision = w.Dropdown(options=ZERO_PRECISIONS, value=precision,
                                    description="precision")
        self.zero_stage = w.IntSlider(value=zero_stage, min=0, max=3, description="ZeRO stage",
                                      **wide)
        self.gpus = w.SelectionSlider(options=GPU_COUNTS, value=gpus, description="GPUs", **wide)
        self.offload = w.Checkbox(value=offload, description="offload to host (ZeRO-Offload)",
                                  **wide)
        self.button = w.Button(icon="play", layout=w.Layout(width="260px"))
        self.note, self.output = w.HTML(), w.Output()
        self.result: ZeroResult | None = None
        for control in (self.model, self.precision, self.zero_stage, self.gpus, self.offload):
            control.observe(lambda _: self.update(), names="value")
        self.button.on_click(lambda _: self.measure())
        self.widget = w.VBox([w.HBox([self.model, self.precision, self.offload]),
                              w.HBox([self.zero_stage, self.gpus]), w.HBox([self.button]),
                              self.note, self.output])
        self.update()

    def values(self) -> dict:
        return dict(model=self.model.value, precision=self.precision.value, batch=self.batch,
                    zero_stage=self.zero_stage.value, gpus=self.gpus.value,
                    offload=self.offload.value)

    def _show(self, result: ZeroResult):
        from labkit.core.units import Breakdown
        self.result, n = result, self.gpus.value
        reason = why_not_measurable(self.model.value, precision=self.precision.value,
                                    zero_stage=self.zero_stage.value, gpus=n)
        self.button.description = f"measure on {n} local process{'es' if n > 1 else ''}"
        # a setting the estimate refuses (offload at stage 0) is explained in the output
        self.button.disabled = reason is not None or result.estimate is None
        self.button.tooltip = reason or ""
        self.note.value = f"ⓘ {reason}" if reason else ""
        if result.error:
            _render(self.output, result.summary())
            return
        figures = [breakdown_figure(
            {"one GPU, no sharding": result.unsharded,
             f"{result.scheme} over {n}: each rank": result.estimate},
            title=f"{result.config.name}: one step's peak per GPU, batch {result.batch} x "
                  f"{result.seq} tokens (CUDA defaults)")]
        if result.measured:
            figures.append(breakdown_figure(
                {"predicted (CPU defaults)": result.cpu,
                 **{f"measured, rank {r.rank}": Breakdown(**r.peak_by_category)
                    for r in result.measured}},
                title=f"{result.scheme} on {n} local processes (gloo): measured vs predicted"))
        _render(self.output, result.summary(), *figures)

    def update(self) -> ZeroResult:
        self._show(zero_report(**self.values()))
        return self.result

    def measure(self) -> ZeroResult:
        self.note.value = (f"measuring {MEASURE_STEPS} steps on {self.gpus.value} local "
                           "processes (gloo), 3-10 s…")
        self.button.disabled = True
        self._show(zero_report(**self.values(), measure=True))    # sets the button again
        return self.result


def zero_panel(**defaults) -> w.VBox:
    """The ZeRO panel of lab 04 (``ZeroPanel`` holds its state and callbacks)."""
    return ZeroPanel(**defaults).widget
