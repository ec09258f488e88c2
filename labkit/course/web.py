"""The course website's calculator and the lab pages' live panels: labkit's own estimate,
planner and panel reports behind a form, as JSON in and out. The pages run this module under
Pyodide (labkit's wheel in the browser); the tests run it in CPython on the same forms and
compare the answers byte for byte. Torch-free."""
from __future__ import annotations

import json
from typing import Callable, NamedTuple

from labkit.core.config import ModelConfig, preset, presets
from labkit.core.gpus import GPUS
from labkit.core.recipe import (FINE_TUNING, OPTIMIZER_IMPLS, OPTIMIZERS, PRECISIONS, SCHEDULES,
                                Layout, Recipe, fine_tuning_fields)
from labkit.core.recompute import RECOMPUTE_POLICIES
from labkit.core.units import CATEGORIES, CATEGORY_COLORS, OP_COLORS, fmt_bytes
from labkit.course import panel_reports as reports
from labkit.predict import estimate

# the forms' fields and their defaults: one GPU's step, and the planner's question
ESTIMATE_FORM = dict(model="llama-2-7b", config="", batch=1, seq=4096, precision="bf16-mixed",
                     optimizer="adamw", optimizer_impl="foreach", recompute="none",
                     fine_tuning="all", dp=1, zero_stage=0, fsdp2_bf16=False, replicas=1,
                     offload=False, tp=1, sp=False, pp=1, schedule="1f1b", micro_batches=0,
                     ep=1, etp=1, cp=1)
PLAN_FORM = dict(model="llama-3-8b", config="", gpu="h100-80gb", gpus=16, gpus_per_node=8,
                 seq=4096, global_batch=0, fine_tuning="all")


def assumed(precision: str) -> str:
    """What every estimate on the page assumes, for ``precision``."""
    cache = "; autocast's weight cache on" if precision.endswith("-mixed") else ""
    return ("CUDA's defaults: tensor bytes as torch.cuda.max_memory_allocated counts them "
            "(nvidia-smi shows more: the CUDA context, the allocator's cached blocks)"
            f"{cache}; SDPA attention; the whole logits at once")


def choices() -> dict:
    """What each of the forms' lists offers, their defaults, and what the estimate assumes."""
    from labkit import __version__
    return {"version": __version__, "model": presets(), "precision": list(PRECISIONS),
            "optimizer": list(OPTIMIZERS), "optimizer_impl": list(OPTIMIZER_IMPLS),
            "recompute": [p for p in RECOMPUTE_POLICIES if p != "every-k"] + ["every-2"],
            "fine_tuning": list(FINE_TUNING), "schedule": list(SCHEDULES),
            "zero_stage": [0, 1, 2, 3], "gpu": list(GPUS), "estimate_form": ESTIMATE_FORM,
            "plan_form": PLAN_FORM}


def _model(form: dict) -> ModelConfig:
    """The preset named, or a pasted Hugging Face config.json (its text)."""
    text = str(form.get("config") or "").strip()
    if not text:
        return preset(form["model"])
    from labkit.core.hf import from_hf_config
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the pasted config.json is not JSON ({e.msg}, line {e.lineno}): paste "
                         f"the whole file") from None
    if not isinstance(fields, dict):
        raise ValueError("paste the config.json object itself ({...}), not a list or a number")
    return from_hf_config(fields)


def _whole(form: dict, name: str) -> int:
    value = form[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return int(value)


def _step(form: dict) -> tuple[Recipe, Layout]:
    """The form's Recipe and Layout (labkit's ValueErrors name the fix)."""
    recompute, every = form["recompute"], 2
    if recompute.startswith("every-"):
        recompute, every = "every-k", int(recompute.split("-")[1])
    recipe = Recipe(form["precision"], form["optimizer"], form["optimizer_impl"],
                    recompute=recompute, every=every, **fine_tuning_fields(form["fine_tuning"]))
    numbers = {k: _whole(form, k) for k in ("dp", "zero_stage", "replicas", "tp", "pp", "ep",
                                            "etp", "cp", "micro_batches")}
    layout = Layout(**numbers | {"micro_batches": numbers["micro_batches"] or None},
                    sp=bool(form["sp"]), offload=bool(form["offload"]), schedule=form["schedule"],
                    virtual_stages=2 if form["schedule"] == "interleaved" else 1,
                    param_dtype="bf16" if form["fsdp2_bf16"] else None)
    return recipe, layout


def estimate_answer(form: dict) -> dict:
    """One GPU's bytes at the step's peak for ``form`` (ESTIMATE_FORM's fields): by category in
    labkit's order, the tensors alive then, the model states per parameter this GPU trains; or
    {"error": why} naming the fix."""
    form = {**ESTIMATE_FORM, **form}
    try:
        cfg = _model(form)
        recipe, layout = _step(form)
        est = estimate(cfg, _whole(form, "batch"), _whole(form, "seq"), recipe=recipe,
                       layout=layout)
    except (ValueError, TypeError, KeyError) as e:
        return {"error": f"{e}" if isinstance(e, ValueError) else
                f"{type(e).__name__}: {e} (check the pasted config.json's fields)"}
    states, local = sum(est.details["model states"].values()), est.details["parameters on this device"]
    return {"model": cfg.name, "total": est.total, "total_text": fmt_bytes(est.total),
            "assumes": [assumed(recipe.precision)] + list(est.details.get("assumes", [])),
            "sharded_over": layout.shard_ranks if layout.zero_stage else 1,
            "offload": layout.offload,
            "categories": _categories(est),
            "peak_phase": est.peak_phase, "peak_moment": est.details.get("peak moment", ""),
            "saved_activations": fmt_bytes(est.saved_activations),
            "parameters_here": local, "model_states": fmt_bytes(states),
            "state_bytes_per_parameter": states / local if local else 0.0,
            "optimizer_impl": est.details.get("optimizer implementation", ""),
            "explain": est.explain()}


def _categories(breakdown) -> list:
    """[label, bytes, text, colour] of each category, in labkit's order."""
    return [[label, getattr(breakdown, key), fmt_bytes(getattr(breakdown, key)),
             CATEGORY_COLORS[key]] for key, label in CATEGORIES.items()]


def plan_answer(form: dict) -> dict:
    """The planner's ranked layouts for ``form`` (PLAN_FORM's fields), its rejected families by
    reason and its assumptions; or {"error": why}."""
    from labkit.course.plan import plan
    form = {**PLAN_FORM, **form}
    try:
        result = plan(_model(form), form["gpu"], _whole(form, "gpus"),
                      gpus_per_node=_whole(form, "gpus_per_node"), seq=_whole(form, "seq"),
                      global_batch=_whole(form, "global_batch") or None,
                      trainable=form["fine_tuning"], top=10)
    except (ValueError, TypeError, KeyError) as e:
        return {"error": f"{e}" if isinstance(e, ValueError) else
                f"{type(e).__name__}: {e} (check the pasted config.json's fields)"}
    out = result.as_dict()
    out.pop("search_s")                     # the clock, not the answer
    out["text"] = result.text(clock=False)
    return out


# ---- the lab pages' live panels: the predict side of a notebook's panel ----------------------
def _bars(items: dict) -> list:
    """A panel's bar chart: {label: Estimate} as [{label, total, total_text, categories}]."""
    return [{"label": label, "total": b.total, "total_text": fmt_bytes(b.total),
             "categories": _categories(b)} for label, b in items.items()]


def _memory_panel(form: dict, changed: str) -> tuple:
    controls = reports.preset_shape(form["model"]) if changed == "model" else {}
    form = {**form, **controls}
    result = reports.predict(form["model"], batch=form["batch"], seq=form["seq"],
                             precision=form["precision"], optimizer=form["optimizer"],
                             **{f: form[f] for f in reports.SHAPE_FIELDS})
    return result, controls


def _states_panel(form: dict, changed: str) -> tuple:
    return reports.states_report(form["model"], precision=form["precision"],
                                 optimizer=form["optimizer"], zero_stage=form["zero_stage"],
                                 gpus=form["gpus"], seq=form["seq"]), {}


def _recompute_panel(form: dict, changed: str) -> tuple:
    return reports.recompute_report(form["model"], layers=form["layers"], seq=form["seq"],
                                    batch=form["batch"], policy=form["policy"],
                                    precision=form["precision"]), {}


def _pipeline_panel(form: dict, changed: str) -> tuple:
    controls = {}
    if changed == "model":
        new = reports.pipeline_controls(form["model"], form["tp"])
        controls = {"tp": {"options": new["tp_options"], "value": new["tp"]},
                    "pp": {"max": new["pp_max"], "value": min(form["pp"], new["pp_max"])}}
        form = {**form, **{name: c["value"] for name, c in controls.items()}}
    return reports.pipeline_report(form["model"], tp=form["tp"], pp=form["pp"],
                                   micro_batches=form["micro_batches"],
                                   schedule=form["schedule"], sp=form["sp"],
                                   seq=form["seq"]), controls


def _plan_panel(form: dict, changed: str) -> tuple:
    return reports.plan_report(form["model"], gpu=form["gpu"], gpus=form["gpus"],
                               seq=form["seq"], trainable=form["trainable"]), {}


def _pipeline_figures(result) -> dict:
    """The stage bars and, where the notebook draws it (p x m up to GANTT_MAX), the simulated
    schedule: [kind, micro-batch, chunk, start, end] per op and stage."""
    stages = [{"label": label, "total": s["total"], "total_text": fmt_bytes(s["total"]),
               "saved": s["saved_activations"], "saved_text": fmt_bytes(s["saved_activations"])}
              for label, s in result.shown_stages().items()]
    t, gantt = result.timeline, None
    if result.gantt_drawn:
        split = any(span.op.kind == "W" for stage in t.stages for span in stage)
        gantt = {"title": reports.gantt_title(t), "v": t.v, "colors": OP_COLORS,
                 "names": [[kind, name] for kind, name in reports.op_names(split).items()],
                 "stages": [[[op.kind, op.micro_batch, op.chunk, float(start), float(end)]
                             for op, start, end in stage] for stage in t.stages]}
    return {"stages": stages, "stage_key": [list(reports.STAGE_KEY[k]) for k in ("peak", "kept")],
            "gantt": gantt}


class LivePanel(NamedTuple):
    """How the site runs a notebook panel: its answer, what stays in JupyterLab (the panel's
    measuring side), and whether an answer can take seconds (the page says so first)."""

    answer: Callable
    note: str = ""
    slow: bool = False


PANELS = {
    "memory_panel": LivePanel(_memory_panel, "Measuring the same step on fake tensors (the "
                                             "panel's button) runs PyTorch: open this lab in "
                                             "JupyterLab."),
    "states_panel": LivePanel(_states_panel),
    "recompute_panel": LivePanel(_recompute_panel, "What recomputation adds in FLOPs is counted "
                                                   "on fake tensors (PyTorch): the notebook's "
                                                   "panel prints it."),
    "pipeline_panel": LivePanel(_pipeline_panel),
    "plan_panel": LivePanel(_plan_panel, slow=True),
}


def panel_answer(panel: str, form: dict, changed: str = "") -> dict:
    """What the notebook's ``panel`` shows for ``form`` (its controls' values by the panel's
    attribute names, and its fixed arguments): the summary text, the bars and their title, and
    for the pipeline the stages and the schedule; ``changed`` (a control's name) may set other
    controls, as the notebook's panel does when a model is chosen ("controls": {name: value
    or {...}})."""
    if panel not in PANELS:
        raise ValueError(f"panel is one of {', '.join(PANELS)}, got {panel!r}")
    result, controls = PANELS[panel].answer(form, changed)
    out = {"summary": result.summary(), "controls": controls, "title": None, "bars": [],
           "stages": [], "stage_key": [], "gantt": None}
    if result.error:
        return out
    out["title"] = result.bars_title()
    if panel == "pipeline_panel":
        return out | _pipeline_figures(result)
    return out | {"bars": _bars(result.bars())}


def answer(kind: str, form_json: str) -> str:
    """The pages' one entry point: JSON in, JSON out. "estimate" and "plan" take a form;
    "panel" takes {"panel": ..., "form": {...}, "changed": ...} (``panel_answer``)."""
    answers = {"estimate": estimate_answer, "plan": plan_answer,
               "panel": lambda q: panel_answer(q["panel"], q["form"], q.get("changed", ""))}
    if kind not in answers:
        raise ValueError(f"kind is 'estimate', 'plan' or 'panel', got {kind!r}")
    return json.dumps(answers[kind](json.loads(form_json)), sort_keys=True)
