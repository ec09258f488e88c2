"""ipywidgets panels. Thin on purpose: every panel calls plain functions that the tests call.

    lk.widgets.memory_panel()     # pick a model and a step, see the predicted breakdown;
                                  # a button measures the same step on fake tensors
    lk.widgets.states_panel()     # lab 01: bytes per parameter of each state, sharded by ZeRO
    lk.widgets.recompute_panel()  # lab 03: a checkpointing policy's memory and recompute cost
    lk.widgets.zero_panel()       # lab 04: ZeRO stage and GPUs -> each rank's memory, measured
    lk.widgets.pipeline_panel()   # lab 05: tp, pp, micro-batches, schedule -> stages, Gantt
    lk.widgets.quant_panel()      # lab 06: scheme, bits, block -> bits per parameter, error
    lk.widgets.attention_panel()  # lab 07: attention core's memory by implementation, KV cache
    lk.widgets.allocator_panel()  # lab 08: what the CUDA caching allocator reserves for a step
    lk.widgets.plan_panel()       # lab 09: the layouts that fit a cluster, fastest first
"""
from __future__ import annotations

import base64
import functools
import io
from dataclasses import dataclass
from fractions import Fraction

import ipywidgets as w
import torch

from .allocator import AllocatorSettings, replay
from .attention import (ATTENTION_IMPLS, CORE_DTYPE, SRAM_PER_SM, CoreBytes, KiB,
                        attention_core_bytes, hbm_ratio)
from .config import ModelConfig, preset, presets
from .generate import attention_kind, mla_reduction
from .gptq import gptq_quantize, rtn_quantize
from .layers import count_params
from .predict import Estimate, estimate, kv_cache_bytes
from .plot import (allocator_figure, bits_error_figure, breakdown_figure, gantt_figure,
                   new_figure, stage_peaks_figure, timeline_figure, unit_for)
from .measure import Measurement, measure_step
from .papers import pipeline_bubble
from .quant import dequantize, quantize_int8, quantize_nf4
from .parallel import pipeline, schedules, zero
from .recipe import OPTIMIZERS, PRECISIONS, Layout, state_bytes
from .units import CATEGORIES, check_choice, check_positive, dtype_bytes, fmt_bytes, fmt_count

SHAPE_FIELDS = ("hidden", "layers", "heads", "vocab_size")


@dataclass
class PanelResult:
    """What a panel shows: a result, or the reason there is none (never a traceback)."""

    config: ModelConfig | None = None
    estimate: Estimate | None = None
    measurement: Measurement | None = None
    error: str | None = None
    recipe: str = ""                     # "precision optimizer", named in the summary

    def summary(self) -> str:
        if self.error:
            return f"⚠ {self.error}"
        pc = count_params(self.config)
        e = self.estimate
        parts = ", ".join(f"{label} {fmt_bytes(getattr(e, key))}"
                          for key, label in CATEGORIES.items() if getattr(e, key))
        text = (f"{self.config.name}, {self.recipe}: {fmt_count(pc.total)} parameters — predicted peak per GPU "
                f"(CUDA defaults: {e.details['optimizer implementation']} AdamW) "
                f"{fmt_bytes(e.total)} (during {e.peak_phase}): {parts}")
        if self.measurement is not None:
            m = self.measurement
            text += (f"\nmeasured peak {fmt_bytes(m.total)} (during {m.peak_phase}); "
                     f"prediction off by {100 * (e.total - m.total) / m.total:+.2f}%")
        return text


def _render(output: w.Output, *items) -> None:
    """Replace what ``output`` shows with ``items`` (text lines or figures).

    The outputs are set as widget state, never captured with ``with output:``: capturing
    redirects the running cell's messages through the widget (its ``msg_id``) and sends
    ``clear_output`` to the cell, the protocol behind notebooks that stall headless
    (papermill #723, nbclient #312) with the kernel idle.
    """
    shown = []
    for item in items:
        if isinstance(item, str):
            shown.append({"output_type": "stream", "name": "stdout", "text": item + "\n"})
        else:                                 # a matplotlib figure, as the inline backend shows it
            png = io.BytesIO()
            item.savefig(png, format="png", bbox_inches="tight")
            shown.append({"output_type": "display_data", "metadata": {}, "data": {
                "image/png": base64.b64encode(png.getvalue()).decode(), "text/plain": repr(item)}})
    output.outputs = tuple(shown)


def model_config(name: str, **shape) -> ModelConfig:
    """The preset ``name`` with its shape fields (hidden, layers, heads, vocab_size) changed."""
    base = preset(name)
    changes = {k: v for k, v in shape.items() if v is not None and getattr(base, k) != v}
    return base.replace(name=name if not changes else f"{name} (modified)", **changes)


def predict(name: str, *, batch: int, seq: int, precision: str, optimizer: str,
            **shape) -> PanelResult:
    """Configuration and estimate from the panel's values, or the error explained."""
    try:
        cfg = model_config(name, **shape)
        return PanelResult(cfg, estimate(cfg, batch=batch, seq=seq, precision=precision,
                                         optimizer=optimizer), recipe=f"{precision} {optimizer}")
    except ValueError as error:
        return PanelResult(error=str(error))


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
        cfg = preset(change["new"])
        self._syncing = True                       # one update for the whole new shape
        for field, control in self.shape.items():
            control.value = getattr(cfg, field)
        self._syncing = False
        self.update()

    def _show(self, result: PanelResult):
        self.result = result
        self.status.value = "<br>".join(result.summary().splitlines())
        if result.error:
            _render(self.output)
            return
        items = {"predicted": result.estimate}
        if result.measurement is not None:
            items["measured (fake tensors)"] = result.measurement
        _render(self.output, breakdown_figure(items),
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
    """The memory panel of labs 00 and 01 (``MemoryPanel`` holds its state and callbacks)."""
    return MemoryPanel(**defaults).widget


# ---- lab 03: recomputation ---------------------------------------------------------------------
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
        from .checkpointing import RECOMPUTE_POLICIES
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
        from .checkpointing import recompute_cost
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


# ---- lab 01: model states, sharded by ZeRO -----------------------------------------------------
# each state's field in ``recipe.StateBytes`` -> its name in ``parallel.zero`` and its label
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
    GPUs (``recipe.state_bytes`` split as ``parallel.zero`` splits it), and the step's estimate
    per GPU (CUDA defaults) beside one GPU without ZeRO; an impossible setting is explained."""
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


# ---- lab 04: ZeRO over N GPUs, predicted, and measured on N local processes ---------------------
COURSE_MODELS = ("tiny", "small", "tiny-moe")     # small enough to train on local processes
ZERO_PRECISIONS = ("fp32", "bf16-master", "bf16-mixed")
MEASURABLE_GPUS = (2, 4)                          # gloo ranks that a laptop's cores run in seconds
GPU_COUNTS = [2 ** k for k in range(11)]          # 1, 2, 4, ..., 1024
MEASURE_STEPS = 3                                 # the last one is steady (DDP rebuilt its buckets)


def why_not_measurable(model: str, *, precision: str, zero_stage: int, gpus: int) -> str | None:
    """Why this step cannot be measured on local processes here, naming what to choose; None
    when it can."""
    from .parallel import zero_step
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
    from .parallel import cluster, ddp, zero_step
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
        from .units import Breakdown
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


# ---- lab 05: pipeline and tensor parallelism, per stage ------------------------------------------
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
    bubble: float = 0.0                   # labkit.papers.pipeline_bubble: the paper's formula
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


# ---- lab 06: quantisation, bits per parameter against error --------------------------------------
QUANT_SCHEMES = ("int8 absmax", "int8 zero-point", "nf4", "rtn", "gptq")
QUANT_BLOCKS = (32, 64, 128, 256)                 # values per scale (rtn / gptq: columns per grid)
INT8_GRANULARITIES = ("tensor", "channel")        # int8 only: one scale per tensor or per row
FIXED_BITS = {"int8 absmax": 8, "int8 zero-point": 8, "nf4": 4}
WEIGHT_SHAPE = (256, 1024)                        # (out, in) of the default weight, N(0, 0.02)
CALIBRATION_ROWS, CALIBRATION_RANK = 1024, 64     # GPTQ's inputs: near a rank-64 subspace
SEVEN_B = "llama-2-7b"
QUANT_SWEEP = [("int8 absmax", 8, "tensor", False), ("int8 absmax", 8, "channel", False),
               ("nf4", 4, 64, False), ("nf4", 4, 64, True),
               *((kind, bits, 64, False) for kind in ("rtn", "gptq") for bits in (2, 3, 4, 8))]


@functools.lru_cache(maxsize=4)
def quant_inputs(features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded correlated layer inputs, near one rank-64 subspace plus 0.1 noise, as a
    transformer's activations are: (calibration, held-out), each (1024, features). GPTQ is
    calibrated on the first; output errors are measured on the second."""
    g = torch.Generator().manual_seed(0)
    mixing = torch.randn(CALIBRATION_RANK, features, generator=g)              # (64, in)
    low_rank = torch.randn(2 * CALIBRATION_ROWS, CALIBRATION_RANK, generator=g) @ mixing
    inputs = low_rank + 0.1 * torch.randn(2 * CALIBRATION_ROWS, features, generator=g)
    return inputs[:CALIBRATION_ROWS], inputs[CALIBRATION_ROWS:]                # (N, in) each


def default_weight() -> torch.Tensor:
    """The panel's weight: seeded N(0, 0.02), (256, 1024) as nn.Linear.weight (out x in)."""
    return torch.randn(WEIGHT_SHAPE, generator=torch.Generator().manual_seed(0)) * 0.02


@dataclass
class QuantResult(PanelResult):
    """One weight quantised: exact stored bits per parameter, the relative errors of the weight
    and of the layer's outputs, and what all of a 7B model's weights take at that format."""

    label: str = ""
    nbytes: int = 0                      # stored bytes of the quantised weight
    numel: int = 0
    weight_error: float = 0.0            # relative ||W - W~||_F / ||W||_F
    output_error: float = 0.0            # ||X (W - W~)^T||_F / ||X W^T||_F, held-out inputs
    model_bytes: float = 0.0             # SEVEN_B's parameters, every one at this format

    @property
    def bits_per_param(self) -> float:
        return 8 * self.nbytes / self.numel

    def summary(self) -> str:
        if self.error:
            return f"⚠ {self.error}"
        gptq = (f"; GPTQ calibrated on {CALIBRATION_ROWS} other seeded inputs from the same "
                f"rank-{CALIBRATION_RANK} subspace" if self.label.startswith("gptq") else "")
        return "\n".join([
            f"{self.label}: {self.nbytes:,} bytes for {self.numel:,} weights = "
            f"{self.bits_per_param:.4f} bits ({self.bits_per_param / 8:.4f} bytes) per parameter",
            f"relative error: weight {self.weight_error:.4f}, layer output {self.output_error:.4f} "
            f"(held-out correlated inputs){gptq}",
            f"{SEVEN_B}'s {count_params(preset(SEVEN_B)).total / 1e9:.2f} B parameters at this "
            f"format: {self.model_bytes / 2**30:.2f} GiB (bf16: "
            f"{count_params(preset(SEVEN_B)).total * 2 / 2**30:.2f} GiB)"])


def quant_label(scheme: str, bits: int, block, double_quant: bool = False) -> str:
    """The name a setting goes by in the text and the figure: "rtn int4 g64", "nf4 b64 dq"."""
    if scheme.startswith("int8"):
        return f"{scheme} per {block}" if block in INT8_GRANULARITIES else f"{scheme} b{block}"
    if scheme == "nf4":
        return f"nf4 b{block}" + (" dq" if double_quant else "")
    return f"{scheme} int{bits} g{block}"


def _check_quant_setting(scheme: str, bits: int, block, double_quant: bool) -> None:
    check_choice("scheme", scheme, QUANT_SCHEMES)
    fixed = FIXED_BITS.get(scheme)
    if fixed is not None and bits != fixed:
        raise ValueError(f"{scheme} stores {fixed}-bit codes: set bits to {fixed}, or choose rtn "
                         f"or gptq for {bits} bits")
    if block in INT8_GRANULARITIES and not scheme.startswith("int8"):
        raise ValueError(f"one scale per {block} is an int8 option here: choose a block of "
                         f"{', '.join(map(str, QUANT_BLOCKS))} for {scheme}")
    if double_quant and scheme != "nf4":
        raise ValueError("double quantisation stores NF4's block scales in 8 bits: choose nf4, "
                         "or turn it off")


def _quantize(scheme: str, bits: int, block, double_quant: bool,
              weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(dequantised weight, stored bytes) of one setting, by labkit.quant or labkit.gptq."""
    if scheme.startswith("int8"):
        granularity = block if block in INT8_GRANULARITIES else "block"
        q = quantize_int8(weight, scheme.removeprefix("int8 "), granularity,
                          block if granularity == "block" else 64)
        return dequantize(q), q.nbytes
    if scheme == "nf4":
        q = quantize_nf4(weight, block, double_quant)
        return dequantize(q), q.nbytes
    if scheme == "rtn":
        q = rtn_quantize(weight, bits, block)
    else:                                        # lazy batches must hold whole groups
        inputs, _ = quant_inputs(weight.shape[1])
        q = gptq_quantize(weight, inputs, bits, block, block=max(128, block))
    return q.weight, q.nbytes


def quant_report(scheme: str, bits: int, block, double_quant: bool = False,
                 weight: torch.Tensor | None = None) -> QuantResult:
    """``weight`` (default: ``default_weight()``) quantised by ``scheme`` (QUANT_SCHEMES) at
    ``bits`` with one scale per ``block`` values (int8 also "tensor" or "channel"): exact bits
    per parameter, relative errors, a 7B model's bytes; an impossible setting in ``.error``."""
    weight = default_weight() if weight is None else weight.detach().float()
    try:
        _check_quant_setting(scheme, bits, block, double_quant)
        if weight.dim() != 2:
            raise ValueError(f"weight is (out, in) as nn.Linear.weight, got shape "
                             f"{tuple(weight.shape)}")
        approx, nbytes = _quantize(scheme, bits, block, double_quant, weight)   # (out, in)
    except ValueError as error:
        return QuantResult(error=str(error))
    _, held_out = quant_inputs(weight.shape[1])                                 # (N, in)
    output_error = (held_out @ (weight - approx).T).norm() / (held_out @ weight.T).norm()
    return QuantResult(label=quant_label(scheme, bits, block, double_quant), nbytes=nbytes,
                       numel=weight.numel(),
                       weight_error=((weight - approx).norm() / weight.norm()).item(),
                       output_error=output_error.item(),
                       model_bytes=count_params(preset(SEVEN_B)).total * nbytes / weight.numel())


@functools.lru_cache(maxsize=1)
def quant_reference() -> tuple[QuantResult, ...]:
    """``quant_report`` of every QUANT_SWEEP setting on the default weight (~1.5 s, once)."""
    return tuple(quant_report(*setting) for setting in QUANT_SWEEP)


class QuantPanel:
    """Scheme, bits, block and double quantisation -> bits per parameter, the weight's and the
    layer output's error, a 7B model's bytes, and the point among a reference sweep."""

    def __init__(self, scheme: str = "nf4", bits: int | None = None, block=64,
                 double_quant: bool = True):
        check_choice("scheme", scheme, QUANT_SCHEMES)
        check_choice(f"block for {scheme}", block, self._blocks(scheme))
        bits = bits or FIXED_BITS.get(scheme, 4)         # None: the scheme's own width, or 4
        self.scheme = w.Dropdown(options=QUANT_SCHEMES, value=scheme, description="scheme")
        self.bits = w.IntSlider(value=bits, min=2, max=8, description="bits")
        self.block = w.Dropdown(options=self._blocks(scheme), value=block, description="block")
        self.double_quant = w.Checkbox(value=double_quant, description="double quantisation",
                                       disabled=scheme != "nf4")
        self.output = w.Output()
        self.result: QuantResult | None = None
        self.reference = quant_reference()
        self._syncing = False
        self.scheme.observe(self._on_scheme, names="value")
        for control in (self.bits, self.block, self.double_quant):
            control.observe(lambda _: self._syncing or self.update(), names="value")
        self.widget = w.VBox([w.HBox([self.scheme, self.bits]),
                              w.HBox([self.block, self.double_quant]), self.output])
        self.update()

    @staticmethod
    def _blocks(scheme: str) -> tuple:
        return QUANT_BLOCKS + (INT8_GRANULARITIES if scheme.startswith("int8") else ())

    def _on_scheme(self, change):
        scheme = change["new"]
        self._syncing = True                     # one update for the scheme's controls
        self.bits.value = FIXED_BITS.get(scheme, self.bits.value)
        block = self.block.value
        self.block.options = self._blocks(scheme)
        self.block.value = block if block in self.block.options else 64
        self.double_quant.disabled = scheme != "nf4"
        self._syncing = False
        self.update()

    def update(self) -> QuantResult:
        scheme = self.scheme.value
        result = quant_report(scheme, self.bits.value, self.block.value,
                              self.double_quant.value and scheme == "nf4")
        self.result = result
        if result.error:
            _render(self.output, result.summary())
            return result
        rows = [(r.label, r.bits_per_param, r.output_error) for r in self.reference]
        labels = [row[0] for row in rows]
        if result.label not in labels:
            rows.append((result.label, result.bits_per_param, result.output_error))
            labels.append(result.label)
        _render(self.output, result.summary(), bits_error_figure(
            rows, highlight=labels.index(result.label),
            ylabel="layer output error ||X(W - W~)ᵀ|| / ||XWᵀ||",
            title=f"{result.label} among the reference settings (weight {WEIGHT_SHAPE[0]} x "
                  f"{WEIGHT_SHAPE[1]}, held-out correlated inputs)"))
        return result


def quant_panel(**defaults) -> w.VBox:
    """The quantisation panel of lab 06 (``QuantPanel`` holds its state and callbacks)."""
    return QuantPanel(**defaults).widget


# ---- lab 07: the attention core's memory, and the KV cache -------------------------------------
HBM_GPUS = ("A100", "H100 SXM")  # SRAM_PER_SM's GPUs whose HBM-access ratio the panel prints
SEQ_CURVE = [2 ** k for k in range(9, 16)]            # 512 ... 32768: the attention curve's x
CONTEXT_CURVE = [2 ** k for k in range(10, 18)]       # 1024 ... 131072: the cache curve's x


def mha_cache_bytes(cfg: ModelConfig, batch: int, context: int) -> int:
    """The KV cache ``cfg`` would need with multi-head attention: 2 x heads x head_dim numbers
    per token and layer (MLA: DeepSeek-V2's baseline, ``generate.mla_reduction``), in bf16."""
    per_layer = (mla_reduction(cfg).mha_per_layer if cfg.attention == "mla"
                 else 2 * cfg.heads * cfg.head_dim)
    return batch * context * cfg.layers * per_layer * dtype_bytes(CORE_DTYPE)


@dataclass
class AttentionResult(PanelResult):
    """The attention panel's result: one layer's core (``core``, and every implementation's
    in ``by_impl``) and the HBM-access ratio at that sequence; the model's KV cache at
    ``context`` beside what multi-head attention would cache."""

    core: CoreBytes | None = None
    by_impl: dict | None = None          # implementation -> CoreBytes at the same shape
    seq: int = 0
    heads: int = 0
    head_dim: int = 0
    hbm: dict | None = None              # GPU -> standard / FlashAttention HBM accesses
    batch: int = 1
    context: int = 0
    kind: str = ""                       # labkit.generate.attention_kind: MHA, GQA, MQA, MLA
    cache: int = 0                       # labkit.kv_cache_bytes(config, batch, context)
    mha_cache: int = 0

    def summary(self) -> str:
        if self.error:
            return f"⚠ {self.error}"
        c, core = self.config, self.core
        by_impl = ", ".join(f"{impl} {fmt_bytes(r.peak)}" for impl, r in self.by_impl.items())
        hbm = ", ".join(f"{ratio:.1f}x on {gpu} ({SRAM_PER_SM[gpu].per_sm // KiB} KiB per SM)"
                        for gpu, ratio in self.hbm.items())
        plural = "s" if c.kv_heads > 1 else ""
        heads = (f"{c.kv_heads} kv head{plural} for {c.heads} query heads"
                 if c.attention == "gqa" else
                 f"latent {c.kv_lora_rank} + RoPE key {c.qk_rope_dim} for {c.heads} heads")
        return "\n".join([
            f"{core.impl} attention core, one layer, batch 1, {CORE_DTYPE}, {self.heads} heads "
            f"x {self.head_dim}, seq {self.seq:,}: keeps {fmt_bytes(core.kept_total)} for the "
            f"backward pass beyond q, k, v ({_named(core.kept)})",
            f"forward + backward peak beyond q, k, v: {fmt_bytes(core.peak)} "
            f"({_named(core.at_peak)})",
            f"peak by implementation at this shape: {by_impl}",
            f"HBM reads and writes of one head's forward, standard attention / FlashAttention: "
            f"{hbm}",
            f"KV cache of {c.name} ({self.kind}: {heads}), batch {self.batch}, context "
            f"{self.context:,}, {CORE_DTYPE}: {fmt_bytes(self.cache)}; with MHA "
            f"{fmt_bytes(self.mha_cache)} ({self.mha_cache / self.cache:.1f}x)"])


def _named(terms: dict) -> str:
    return ", ".join(f"{name} {fmt_bytes(n)}" for name, n in terms.items())


def attention_report(impl: str, *, seq: int, heads: int, head_dim: int, model: str,
                     context: int, batch: int = 1, kv_heads: int | None = None) -> AttentionResult:
    """One layer's attention core (``attention_core_bytes``) for each implementation, and the
    KV cache of ``model`` (``kv_heads`` changed, if given) at ``context`` tokens; an impossible
    setting is explained in ``.error``."""
    try:
        by_impl = {name: attention_core_bytes(name, seq, heads, head_dim)
                   for name in ATTENTION_IMPLS}
        check_choice("attention implementation", impl, ATTENTION_IMPLS)
        check_positive("context (tokens in the KV cache)", context)
        check_positive("batch", batch)
        cfg = model_config(model, kv_heads=kv_heads)
        cache = kv_cache_bytes(cfg, batch, context, CORE_DTYPE)
    except ValueError as error:
        return AttentionResult(error=str(error))
    return AttentionResult(
        cfg, core=by_impl[impl], by_impl=by_impl, seq=seq, heads=heads, head_dim=head_dim,
        hbm={gpu: hbm_ratio(seq, head_dim, gpu) for gpu in HBM_GPUS}, batch=batch,
        context=context, kind=attention_kind(cfg), cache=cache,
        mha_cache=mha_cache_bytes(cfg, batch, context))


def _attention_figure(result: AttentionResult):
    """Left: each core's peak against seq (log-log: slope 2 is T^2), this one marked; right:
    the KV cache and MHA's against context, this context marked."""
    fig, (left, right) = new_figure(9, 3.4, ncols=2)
    for name in ATTENTION_IMPLS:
        peaks = [attention_core_bytes(name, T, result.heads, result.head_dim).peak / 2**20
                 for T in SEQ_CURVE]
        left.plot(SEQ_CURVE, peaks, marker=".", label=name)
    left.scatter([result.seq], [result.core.peak / 2**20], s=120, facecolor="none",
                 edgecolor="black", linewidth=2, zorder=3, label="this setting")
    left.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="MiB",
             title=f"one layer's core, fwd + bwd peak ({result.heads} heads x {result.head_dim})")
    left.legend(frameon=False, fontsize=8)
    cfg, B = result.config, result.batch
    name, scale = unit_for(max(result.mha_cache, mha_cache_bytes(cfg, B, CONTEXT_CURVE[-1])))
    right.plot(CONTEXT_CURVE, [kv_cache_bytes(cfg, B, n, CORE_DTYPE) / scale
                               for n in CONTEXT_CURVE], marker=".", label=result.kind)
    right.plot(CONTEXT_CURVE, [mha_cache_bytes(cfg, B, n) / scale for n in CONTEXT_CURVE],
               marker=".", linestyle="--", color="#999999", label="MHA")
    right.scatter([result.context], [result.cache / scale], s=120, facecolor="none",
                  edgecolor="black", linewidth=2, zorder=3, label="this context")
    right.set(xlabel="context (tokens)", ylabel=name, ylim=(0, None),
              title=f"KV cache, {cfg.name}, batch {B}")
    right.set_xticks([i * 2**15 for i in range(5)], ["0", "32k", "64k", "96k", "128k"])
    right.legend(frameon=False, fontsize=8)
    return fig


class AttentionPanel:
    """Implementation, seq, heads and head dim -> one layer's attention core: what it keeps
    and its peak, and FlashAttention's HBM-access ratio; model, kv heads, context and batch ->
    the KV cache beside multi-head attention's. Choosing a model loads its heads, head dim
    (MLA: q.k width) and kv heads."""

    def __init__(self, impl: str = "sdpa", seq: int = 4096, model: str = "llama-2-7b",
                 context: int = 4096, batch: int = 1):
        check_choice("attention implementation", impl, ATTENTION_IMPLS)
        cfg = preset(model)
        box = {"layout": w.Layout(width="190px")}
        self.impl = w.Dropdown(options=ATTENTION_IMPLS, value=impl, description="implementation",
                               style={"description_width": "initial"})
        self.seq = w.IntSlider(value=seq, min=512, max=32768, step=512, description="seq")
        self.heads = w.IntSlider(value=cfg.heads, min=1, max=128, description="heads")
        self.head_dim = w.IntSlider(value=cfg.qk_head_dim, min=8, max=256, step=8,
                                    description="head dim")
        self.model = w.Dropdown(options=presets(), value=model, description="model")
        self.kv_heads = w.BoundedIntText(value=cfg.kv_heads, min=1, max=1024,
                                         description="kv heads", **box)
        self.context = w.IntSlider(value=context, min=1024, max=131072, step=1024,
                                   description="context")
        self.batch = w.BoundedIntText(value=batch, min=1, max=1024, description="batch", **box)
        self.output = w.Output()
        self.result: AttentionResult | None = None
        self._syncing = False
        self.model.observe(self._on_model, names="value")
        for control in (self.impl, self.seq, self.heads, self.head_dim, self.kv_heads,
                        self.context, self.batch):
            control.observe(lambda _: self._syncing or self.update(), names="value")
        self.widget = w.VBox([w.HBox([self.impl, self.seq]), w.HBox([self.heads, self.head_dim]),
                              w.HBox([self.model, self.kv_heads]),
                              w.HBox([self.context, self.batch]), self.output])
        self._show_kv_heads(cfg)
        self.update()

    def _show_kv_heads(self, cfg: ModelConfig):
        self.kv_heads.disabled = cfg.attention == "mla"      # MLA caches a latent, no heads

    def _on_model(self, change):
        cfg = preset(change["new"])
        self._syncing = True                     # one update for the model's shape
        self.heads.value, self.head_dim.value = cfg.heads, cfg.qk_head_dim
        self.kv_heads.value = cfg.kv_heads
        self._syncing = False
        self._show_kv_heads(cfg)
        self.update()

    def update(self) -> AttentionResult:
        mla = preset(self.model.value).attention == "mla"
        result = attention_report(self.impl.value, seq=self.seq.value, heads=self.heads.value,
                                  head_dim=self.head_dim.value, model=self.model.value,
                                  context=self.context.value, batch=self.batch.value,
                                  kv_heads=None if mla else self.kv_heads.value)
        self.result = result
        if result.error:
            _render(self.output, result.summary())
        else:
            _render(self.output, result.summary(), _attention_figure(result))
        return result


def attention_panel(**defaults) -> w.VBox:
    """The attention and KV-cache panel of lab 07 (``AttentionPanel`` holds its state and
    callbacks)."""
    return AttentionPanel(**defaults).widget


def _wire(panel, rows: list[list]) -> None:
    """A panel's controls, a row each, over its output: any change calls ``panel.update()``."""
    panel.output = w.Output()
    for control in (c for row in rows for c in row):
        control.observe(lambda _: panel.update(), names="value")
    panel.widget = w.VBox([w.HBox(row) for row in rows] + [panel.output])
    panel.update()


# ---- lab 08: the caching allocator ---------------------------------------------------------------
ALLOCATOR_MODELS = ("tiny", "small", "tiny-moe")
ALLOCATORS = {"native": AllocatorSettings(),
              "expandable segments": AllocatorSettings(expandable_segments=True)}


@dataclass
class AllocatorResult:
    """Two steps of a course model on fake tensors (CUDA's defaults) replayed through the
    caching allocator under each setting; ``allocator`` is the one the summary leads with."""

    model: str = ""
    allocator: str = "native"
    batch: int = 0
    seq: int = 0
    precision: str = ""
    tracker_peak: int = 0
    replays: dict | None = None
    error: str | None = None

    def summary(self) -> str:
        if self.error:
            return f"⚠ {self.error}"
        chosen = self.replays[self.allocator]
        others = ", ".join(f"{label} {fmt_bytes(r.peak_reserved)}"
                           for label, r in self.replays.items() if label != self.allocator)
        over = chosen.peak_reserved / chosen.peak_allocated - 1
        return (f"{self.model}, {self.precision}, two steps of batch {self.batch} x {self.seq} "
                f"(fake tensors, CUDA's defaults): the tensors peak at "
                f"{fmt_bytes(self.tracker_peak)}.\n{self.allocator}: the allocator reserves "
                f"{fmt_bytes(chosen.peak_reserved)} at its peak, {100 * over:.1f}% over its "
                f"allocated blocks ({fmt_bytes(chosen.peak_allocated)}); {others}.")


def allocator_report(model: str, *, batch: int, seq: int, precision: str = "bf16-mixed",
                     allocator: str = "native") -> AllocatorResult:
    """Measure two steps' storage events and replay them under each of ``ALLOCATORS``; an
    impossible setting is explained in ``.error``."""
    try:
        check_choice("allocator", allocator, ALLOCATORS)
        check_choice("model", model, ALLOCATOR_MODELS)
        m = measure_step(model, batch, seq, precision=precision, fake=True, device="cuda",
                         events=True, then=[(batch, seq)])
    except ValueError as error:
        return AllocatorResult(error=str(error))
    replays = {label: replay(m.events, settings) for label, settings in ALLOCATORS.items()}
    return AllocatorResult(model, allocator, batch, seq, precision, m.total, replays)


class AllocatorPanel:
    """Model, precision, batch and seq -> two training steps' blocks and what the caching
    allocator reserves for them, with and without expandable segments."""

    def __init__(self, model: str = "small", precision: str = "bf16-mixed", batch: int = 4,
                 seq: int = 256, allocator: str = "native"):
        self.model = w.Dropdown(options=ALLOCATOR_MODELS, value=model, description="model")
        self.precision = w.Dropdown(options=PRECISIONS, value=precision, description="precision")
        self.allocator = w.Dropdown(options=list(ALLOCATORS), value=allocator,
                                    description="allocator")
        # each change measures two steps: update on release, not on every tick of a drag
        self.batch = w.IntSlider(value=batch, min=1, max=16, description="batch",
                                 continuous_update=False)
        self.seq = w.IntSlider(value=seq, min=32, max=1024, step=32, description="seq",
                               continuous_update=False)
        self.result: AllocatorResult | None = None
        _wire(self, [[self.model, self.precision, self.allocator], [self.batch, self.seq]])

    def update(self) -> AllocatorResult:
        result = allocator_report(self.model.value, batch=self.batch.value, seq=self.seq.value,
                                  precision=self.precision.value, allocator=self.allocator.value)
        self.result = result
        if result.error:
            _render(self.output, result.summary())
        else:
            chosen = {result.allocator: result.replays[result.allocator]}
            others = {k: v for k, v in result.replays.items() if k != result.allocator}
            _render(self.output, result.summary(), allocator_figure({**chosen, **others}))
        return result


def allocator_panel(**defaults) -> w.VBox:
    """The caching-allocator panel of lab 08 (``AllocatorPanel`` holds its state)."""
    return AllocatorPanel(**defaults).widget


# ---- lab 09: the planner ---------------------------------------------------------------------
PLAN_GPU_COUNTS = [2 ** k for k in range(12)]      # 1 ... 2048


@dataclass
class PlanResult:
    """A plan from the panel's values, or why there is none (never a traceback)."""

    plan: object = None                  # labkit.plan.Plan
    error: str | None = None

    def summary(self) -> str:
        if self.error:
            return f"⚠ {self.error}"
        p = self.plan
        head = (f"{p.model} on {p.gpus} x {p.gpu.name}, seq {p.seq}: {len(p.fits)} layouts "
                f"shown fit {fmt_bytes(p.usable)} usable per GPU (searched in {p.search_s:.1f} s); "
                f"{len(p.rejected)} families rejected")
        if not p.fits:
            return "\n".join([head, "nothing fits; what would:"] + [f"  - {a}" for a in p.advice])
        lines = [head] + [f"#{i} {c.time.total:6.2f} s/step, {fmt_bytes(c.estimate.total):>10} per GPU: "
                          f"{c.label()}" for i, c in enumerate(p.fits[:5], 1)]
        lines += [f"rejected: {name}: {why}" for name, why in list(p.rejected.items())[:2]]
        return "\n".join(lines)


def plan_report(model: str, *, gpu: str, gpus: int, seq: int, trainable: str = "all",
                top: int = 5) -> PlanResult:
    """``labkit.plan.plan`` for one model, GPU type, count and sequence length."""
    from .plan import plan
    try:
        return PlanResult(plan(model, gpu, gpus, seq=seq, trainable=trainable, top=top))
    except ValueError as error:
        return PlanResult(error=str(error))


class PlanPanel:
    """Model, GPU type, GPU count, sequence and what trains -> the planner's fastest layouts that
    fit, each one's bytes per GPU by category, and the families rejected with their reason."""

    def __init__(self, model: str = "deepseek-v2-lite", gpu: str = "a100-80gb", gpus: int = 8,
                 seq: int = 4096, trainable: str = "all"):
        from .gpus import GPUS
        from .plan import TRAINABLE
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
            _render(self.output, result.summary())
        else:
            p = result.plan
            items = {f"#{i} {c.label()}": c.estimate for i, c in enumerate(p.fits[:5], 1)}
            _render(self.output, result.summary(), breakdown_figure(
                items, title=f"per-GPU peak of the fastest layouts ({fmt_bytes(p.usable)} usable)"))
        return result


def plan_panel(**defaults) -> w.VBox:
    """The planner panel of lab 09 (``PlanPanel`` holds its state)."""
    return PlanPanel(**defaults).widget


# ---- the panels' main controls, for the browser test ---------------------------------------------
# panel function -> the description of a dropdown (and the option to pick) and of a slider that
# change what it shows. tests/browser finds a lab's panel by its call (``memory_panel(``) in the
# notebook, moves these two controls in JupyterLab and checks that the panel's text or figure
# changed. The option matters: at batch 1 the optimizer step sets the peak, so bf16-mixed and
# fp32 show the same bytes (lab 02's point); pure bf16 halves every state.
PANEL_CONTROLS = {
    "memory_panel": {"dropdown": "precision", "option": "bf16", "slider": "seq"},
    "states_panel": {"dropdown": "optimizer", "slider": "ZeRO stage"},
    "recompute_panel": {"dropdown": "policy", "slider": "layers"},
    "zero_panel": {"dropdown": "precision", "option": "fp32", "slider": "ZeRO stage"},
    "pipeline_panel": {"dropdown": "schedule", "option": "zb-h1", "slider": "pp"},
    "quant_panel": {"dropdown": "scheme", "option": "rtn", "slider": "bits"},
    "attention_panel": {"dropdown": "implementation", "option": "naive", "slider": "seq"},
    "allocator_panel": {"dropdown": "allocator", "option": "expandable segments",
                        "slider": "batch"},
    "plan_panel": {"dropdown": "GPU", "option": "h100-80gb", "slider": "seq"},
}
