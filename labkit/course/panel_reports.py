"""What the predict side of the labs' panels shows, torch-free: the ipywidgets panels
(``labkit.course.widgets``) render these results in JupyterLab, and the course website's lab pages
run the same functions under Pyodide (``labkit.course.web``). A result's ``summary()`` is the
panel's text; an impossible setting is explained in ``.error``, never raised."""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from labkit.core.config import ModelConfig, preset
from labkit.core.recipe import Layout, state_bytes
from labkit.core.units import CATEGORIES, CATEGORY_COLORS, fmt_bytes, fmt_count
from labkit.parallel.data import zero
from labkit.parallel.pipeline import schedules
from labkit.predict import Estimate, estimate
from labkit.predict.layers import count_params
from labkit.predict.papers import pipeline_bubble


# ---- every panel: a model and its estimate (labs 00 and 02's memory panel) -----------------
SHAPE_FIELDS = ("hidden", "layers", "heads", "vocab_size")
BARS_TITLE = "where the memory goes at the peak"        # a breakdown's title, unless it has one


@dataclass
class PanelResult:
    """What a panel shows: a result, or the reason there is none (never a traceback)."""

    config: ModelConfig | None = None
    estimate: Estimate | None = None
    measurement: object = None           # the measuring side's labkit Measurement (torch)
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

    def bars_title(self) -> str:
        """The bar chart's title."""
        return BARS_TITLE

    def bars(self) -> dict:
        """What the panel's bar chart shows: {label: Estimate or Measurement}."""
        measured = {"measured (fake tensors)": self.measurement} if self.measurement else {}
        return {"predicted": self.estimate, **measured}


def preset_shape(name: str) -> dict:
    """The preset's shape fields, what the memory panel's boxes show when it is chosen."""
    cfg = preset(name)
    return {field: getattr(cfg, field) for field in SHAPE_FIELDS}


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


# ---- lab 01: bytes per parameter of each model state, sharded by ZeRO -----------------------
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
            f"model states per GPU: {fmt_bytes(_model_states(e))} "
            f"(one GPU without ZeRO: {fmt_bytes(_model_states(one))})",
            f"peak of one step per GPU, batch {self.batch} x {self.seq} tokens, CUDA defaults: "
            f"{fmt_bytes(e.total)} during {e.peak_phase} (one GPU: {fmt_bytes(one.total)})"])


    def bars(self) -> dict:
        L = self.layout
        return {"one GPU, no ZeRO": self.unsharded,
                f"ZeRO-{L.zero_stage}, {L.dp} GPUs: each": self.estimate}

    def bars_title(self) -> str:
        return (f"{self.config.name}: one step's peak per GPU, batch {self.batch} x {self.seq} "
                f"tokens")


def _model_states(e: Estimate) -> int:
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


# ---- lab 03: a checkpointing policy's memory ------------------------------------------------
@dataclass
class RecomputeResult(PanelResult):
    """The recompute panel's result: the step under ``policy`` beside the same step keeping
    every activation; ``extra_flops`` (what the recomputation adds, a fraction) is counted on
    fake tensors (torch), so only the notebook's panel fills it in."""

    keep: Estimate | None = None
    policy: str = "full"
    extra_flops: float | None = None

    def summary(self) -> str:
        if self.error:
            return f"⚠ {self.error}"
        e, keep = self.estimate, self.keep
        text = (f"saved activations {fmt_bytes(e.saved_activations)} (keeping everything: "
                f"{fmt_bytes(keep.saved_activations)}); peak {fmt_bytes(e.total)} "
                f"(vs {fmt_bytes(keep.total)})")
        if self.extra_flops is not None:
            text += f"; recompute adds {100 * self.extra_flops:.1f}% FLOPs"
        return text

    def bars(self) -> dict:
        return {"keep everything": self.keep, self.policy: self.estimate}


def recompute_report(model: str, *, layers: int, seq: int, batch: int, policy: str,
                     precision: str = "bf16-mixed") -> RecomputeResult:
    """Estimate of one step of ``model`` (with ``layers``) under ``policy`` and without."""
    step = dict(batch=batch, seq=seq, precision=precision)
    try:
        cfg = model_config(model, layers=layers)
        return RecomputeResult(cfg, estimate(cfg, recompute=policy, **step),
                               recipe=f"{precision} adamw", keep=estimate(cfg, **step),
                               policy=policy)
    except ValueError as error:
        return RecomputeResult(error=str(error))


# ---- lab 05: tp, pp, micro-batches and schedule -> each stage's memory, the schedule --------
PIPELINE_SEQS = (512, 1024, 2048, 4096, 8192)
MAX_PP = 16                       # the pp slider's end (fewer when the model has fewer layers)
MAX_MICRO_BATCHES = 32
GANTT_MAX = 256                   # p x m above which the Gantt chart is too dense to read
SHOWN_STAGES = 8                  # more stages: the bars show the first, the middle and the last
INTERLEAVED_CHUNKS = 2            # virtual stages per GPU under the interleaved schedule
MICRO_BATCH = 1                   # sequences per micro-batch: estimate's batch under pp (x m)
BUBBLE_FORMULAS = {"gpipe": "(p-1)/(m+p-1)", "1f1b": "(p-1)/(m+p-1)",
                   "interleaved": "(p-1)/(v m+p-1)", "zb-h1": "(p-1)/(3m+p-1)"}


PANEL_SCHEDULES = tuple(BUBBLE_FORMULAS)   # the schedules the panel simulates (not zb-v, DualPipeV)
# the stage bars' key (notebook and website): each stage's peak, and the activations inside it
STAGE_KEY = {"peak": ("peak per GPU", "#DDDDDD"),
             "kept": ("activations kept for the backward pass (end of the forward passes)",
                      CATEGORY_COLORS["activations"])}


def gantt_title(timeline) -> str:
    """A Gantt chart's title: the schedule, p, m (v), and its idle fraction."""
    chunks = f", v={timeline.v}" if timeline.v > 1 else ""
    return (f"{timeline.name}: p={timeline.p}, m={timeline.m}{chunks}, "
            f"idle {float(timeline.idle_fraction):.1%}")


def op_names(split: bool) -> dict:
    """The legend of a schedule's ops; ``split``: B is the input gradient, W the weights'."""
    if not split:
        return {"F": "F forward", "B": "B backward"}
    return {"F": "F forward", "B": "B input gradient", "W": "W weight gradient"}


def tp_choices(model: str) -> list[int]:
    """The tensor-parallel degrees the panel offers: the divisors of the model's heads up to 8."""
    return [t for t in range(1, 9) if preset(model).heads % t == 0]


def pipeline_controls(model: str, tp: int) -> dict:
    """The pipeline panel's controls once ``model`` is chosen: tp's choices and the largest of
    them up to ``tp``, and the pp slider's end (its layers, at most MAX_PP)."""
    choices = tp_choices(model)
    return {"tp_options": choices, "tp": max(t for t in choices if t <= tp),
            "pp_max": min(preset(model).layers, MAX_PP)}


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

    def shown_stages(self) -> dict:
        """{label: stage} the bars show: every stage, or the first, the middle and the last."""
        p = self.layout.pp
        shown = range(p) if p <= SHOWN_STAGES else (0, p // 2, p - 1)
        return {f"stage {s}": self.stages[s] for s in shown}

    def bars_title(self) -> str:
        L = self.layout
        some = "first, middle and last of " if L.pp > SHOWN_STAGES else ""
        return (f"{self.config.name}: each stage's peak per GPU, tp={L.tp}, pp={L.pp}, "
                f"m={L.micro_batch_count} ({some}{L.pp} stage{'s' if L.pp > 1 else ''})")

    @property
    def gantt_drawn(self) -> bool:
        """The Gantt chart is drawn up to p x m = GANTT_MAX (denser, it cannot be read)."""
        return self.layout.pp * self.layout.micro_batch_count <= GANTT_MAX

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
            f"{BUBBLE_FORMULAS[L.schedule]} = {self.bubble:.1%}{caveat}"]
            + ([] if self.gantt_drawn else [f"(the Gantt chart is drawn for p x m <= {GANTT_MAX}; "
                                            f"here {L.pp} x {m} = {L.pp * m})"]))


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
        in_flight=[schedules.in_flight(s, pp, micro_batches, schedule, v) for s in range(pp)])


# ---- lab 09: the layouts that fit a cluster, fastest first ----------------------------------
PLAN_GPU_COUNTS = [2 ** k for k in range(12)]      # 1 ... 2048


@dataclass
class PlanResult:
    """A plan from the panel's values, or why there is none (never a traceback)."""

    plan: object = None                  # labkit.course.plan.Plan
    error: str | None = None

    def summary(self, clock: bool = False) -> str:
        """The plan in a few lines; ``clock``: with how long the search took."""
        if self.error:
            return f"⚠ {self.error}"
        p = self.plan
        searched = f" (searched in {p.search_s:.1f} s)" if clock else ""
        head = (f"{p.model} on {p.gpus} x {p.gpu.name}, seq {p.seq}: {len(p.fits)} layouts "
                f"shown fit {fmt_bytes(p.usable)} usable per GPU{searched}; "
                f"{len(p.rejected)} families rejected")
        if not p.fits:
            return "\n".join([head, "nothing fits; what would:"] + [f"  - {a}" for a in p.advice])
        lines = [head] + [f"#{i} {c.time.dp_overlapped:6.2f} s/step, {fmt_bytes(c.estimate.total):>10} per GPU: "
                          f"{c.label()}" for i, c in enumerate(p.fits[:5], 1)]
        lines += [f"rejected: {name}: {why}" for name, why in list(p.rejected.items())[:2]]
        return "\n".join(lines)

    def bars(self, top: int = 5) -> dict:
        """{"#i layout": Estimate} of the ``top`` fastest layouts that fit (none: {})."""
        return {f"#{i} {c.label()}": c.estimate for i, c in enumerate(self.plan.fits[:top], 1)}

    def bars_title(self) -> str:
        return f"per-GPU peak of the fastest layouts ({fmt_bytes(self.plan.usable)} usable)"


def plan_report(model: str, *, gpu: str, gpus: int, seq: int, trainable: str = "all",
                top: int = 5) -> PlanResult:
    """``labkit.course.plan.plan`` for one model, GPU type, count and sequence length."""
    from labkit.course.plan import plan
    try:
        return PlanResult(plan(model, gpu, gpus, seq=seq, trainable=trainable, top=top))
    except ValueError as error:
        return PlanResult(error=str(error))


