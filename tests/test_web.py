"""The website's Python side (labkit.course.web): the calculator's answers are labkit's own
estimate and planner, a lab page's live panel shows what the notebook's panel shows, bad input
comes back as the error that names the fix, and no torch is needed (the pages run it under
Pyodide; tests/browser/test_site_in_browser.py compares)."""
import dataclasses
import json
import subprocess
import sys

import pytest

import labkit as lk
from labkit.course import web, widgets


def test_an_estimate_is_lk_estimates_by_category():
    got = web.estimate_answer(dict(model="deepseek-v2-lite", dp=8, ep=8, precision="bf16-master"))
    want = lk.estimate("deepseek-v2-lite", 1, 4096, precision="bf16-master",
                       layout=lk.Layout(dp=8, ep=8))
    assert got["total"] == want.total and got["explain"] == want.explain()
    assert got["categories"][2] == ["optimizer state", want.optimizer, lk.fmt_bytes(want.optimizer),
                                    lk.course.plot.CATEGORY_COLORS["optimizer"]]   # the figures' colour
    assert [label for label, *_ in got["categories"]] == list(lk.CATEGORIES.values())
    # the model states over the step, per parameter this GPU holds: bf16-master's 2 + 2 + 12
    here = want.details["parameters on this device"]
    assert got["parameters_here"] == here < lk.count_params("deepseek-v2-lite").total
    assert got["state_bytes_per_parameter"] == pytest.approx(16, rel=1e-6)


def test_the_per_parameter_figure_is_the_recipes_whatever_the_layout():
    """tp 2 peaks in the forward pass (no gradients yet) and SGD keeps no moments: the figure
    is the step's model states over the parameters this GPU holds, not the peak's."""
    assert web.estimate_answer(dict(tp=2))["state_bytes_per_parameter"] == pytest.approx(16, rel=1e-6)
    assert web.estimate_answer(dict(optimizer="sgd"))["state_bytes_per_parameter"] == 8


def test_fine_tuning_and_a_pasted_config_are_the_estimates():
    qlora = web.estimate_answer(dict(fine_tuning="qlora", precision="bf16"))
    assert qlora["total"] == lk.estimate("llama-2-7b", 1, 4096, precision="bf16",
                                         trainable="lora", weight_format="nf4").total
    config = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1376,
              "num_attention_heads": 8, "num_hidden_layers": 4, "vocab_size": 32000,
              "max_position_embeddings": 4096}
    got = web.estimate_answer(dict(config=json.dumps(config), seq=1024))
    assert got["total"] == lk.estimate(lk.from_hf_config(config), 1, 1024).total


def test_bad_input_comes_back_as_the_error_naming_the_fix():
    assert "choose dp among the multiples of 2" in web.estimate_answer(dict(dp=3, ep=2,
                                                                            model="tiny-moe"))["error"]
    assert "paste the whole file" in web.estimate_answer(dict(config="{"))["error"]
    assert "whole number" in web.estimate_answer(dict(dp=1.5))["error"]
    assert "not a list or a number" in web.estimate_answer(dict(config="[1, 2]"))["error"]
    assert "error" in web.plan_answer(dict(gpu="no-such-gpu"))
    with pytest.raises(ValueError, match="'estimate', 'plan' or 'panel'"):
        web.answer("estimates", "{}")
    with pytest.raises(ValueError, match="panel is one of memory_panel"):
        web.panel_answer("zero_panel", {})                # it measures: JupyterLab only


def test_a_plan_is_the_planners_without_its_clock():
    got = json.loads(web.answer("plan", json.dumps(dict(gpus=16, seq=8192))))
    want = lk.course.plan.plan("llama-3-8b", "h100-80gb", 16, seq=8192, top=10).as_dict()
    assert got["fits"] == json.loads(json.dumps(want["fits"]))
    assert "search_s" not in got and "searched in" not in got["text"]


def test_the_calculator_imports_no_torch():
    form = {"model": "small", "layers": 4, "seq": 512, "batch": 1, "policy": "full",
            "precision": "bf16-mixed"}
    code = ("import sys; from labkit.course import web; web.estimate_answer({}); "
            f"web.plan_answer({{'gpus': 8}}); web.panel_answer('recompute_panel', {form!r}); "
            "print('torch' in sys.modules, 'ipywidgets' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"


# ---- the lab pages' live panels ----------------------------------------------------------
# small models (the next in each list is small too): the notebook's panel runs the planner and
# counts FLOPs on fake tensors at each change
PANEL_ARGS = {"memory_panel": dict(model="small", seq=512), "recompute_panel": dict(model="tiny", seq=256),
              "pipeline_panel": dict(model="small"), "plan_panel": dict(model="small")}


def notebook_panel(name: str):
    """The notebook's panel object (``states_panel`` -> ``StatesPanel``)."""
    return widgets.PANEL_CLASSES[name](**PANEL_ARGS.get(name, {}))


def control_of(panel, name: str):
    return panel.shape[name] if name in getattr(panel, "shape", {}) else getattr(panel, name)


def its_form(panel) -> dict:
    spec = widgets.controls_spec(panel)
    return {c["name"]: c["value"] for c in spec["controls"]} | spec["fixed"]


def shown_text(name: str, result) -> str:
    """The notebook panel's text less what only it measures or times."""
    if name == "recompute_panel":                       # FLOPs counted on fake tensors
        return dataclasses.replace(result, extra_flops=None).summary()
    return result.summary()                             # (the planner's: without its clock)


def another_value(control: dict):
    """A different value a user could pick for ``control`` (a controls_spec entry)."""
    if control["kind"] == "select":
        options = control["options"]
        return options[(options.index(control["value"]) + 1) % len(options)]
    if control["kind"] == "checkbox":
        return not control["value"]
    up = control["value"] + control["step"]
    return up if up <= control["max"] else control["value"] - control["step"]


@pytest.mark.parametrize("name", list(web.PANELS))
def test_a_live_panel_shows_what_the_notebooks_panel_shows(name):
    """Each control moved in turn, in the notebook's panel and in the web answer: the same
    text, the same bars (bytes), and the controls a model choice sets (shape, tp, pp) alike."""
    panel = notebook_panel(name)
    form = its_form(panel)
    assert web.panel_answer(name, form)["summary"] == shown_text(name, panel.result)
    for control in widgets.controls_spec(panel)["controls"]:
        value = another_value(control)
        control_of(panel, control["name"]).value = value        # the notebook's panel reacts
        answer = web.panel_answer(name, {**form, control["name"]: value}, control["name"])
        sets = {k: v["value"] if isinstance(v, dict) else v for k, v in answer["controls"].items()}
        form = {**form, control["name"]: value, **sets}
        assert form == its_form(panel), control["name"]
        assert answer["summary"] == shown_text(name, panel.result), control["name"]
        result = panel.result
        if not result.error:                          # the figure's title and bars
            assert answer["title"] == result.bars_title()
        if answer["bars"]:
            assert [b["total"] for b in answer["bars"]] == [e.total for e in result.bars().values()]
            assert [b["label"] for b in answer["bars"]] == list(result.bars())
        if answer["gantt"]:                            # the notebook's chart title
            assert answer["gantt"]["title"] == widgets.gantt_title(result.timeline)
        if answer["stages"]:
            assert [s["total"] for s in answer["stages"]] == [
                s["total"] for s in result.shown_stages().values()]


def test_the_pipeline_panel_sends_its_schedule_and_a_model_sets_tp_and_pp():
    form = its_form(notebook_panel("pipeline_panel")) | {"pp": 4, "micro_batches": 4}
    gantt = web.panel_answer("pipeline_panel", form)["gantt"]
    assert len(gantt["stages"]) == 4 and all(len(stage) == 2 * 4 for stage in gantt["stages"])
    assert gantt["names"] == [["F", "F forward"], ["B", "B backward"]]
    # past p x m = GANTT_MAX the notebook draws no chart, nor does the page: both say so
    dense = web.panel_answer("pipeline_panel", form | {"model": "llama-2-70b", "pp": 16,
                                                       "micro_batches": 32})
    assert dense["gantt"] is None and len(dense["stages"]) == 3          # first, middle, last
    assert dense["summary"].endswith("(the Gantt chart is drawn for p x m <= 256; here 16 x 32 = 512)")
    assert "(first, middle and last of 16 stages)" in dense["title"]
    sets = web.panel_answer("pipeline_panel", form | {"model": "tiny", "tp": 8}, "model")["controls"]
    assert sets == {"tp": {"options": widgets.tp_choices("tiny"), "value": 4},
                    "pp": {"max": lk.preset("tiny").layers, "value": min(4, lk.preset("tiny").layers)}}


def test_a_panels_impossible_setting_is_its_explanation():
    form = its_form(notebook_panel("states_panel")) | {"zero_stage": 4}
    answer = web.panel_answer("states_panel", form)
    assert answer["summary"].startswith("⚠ ") and "zero_stage must be 0, 1, 2 or 3" in answer["summary"]
    assert answer["bars"] == [] and answer["gantt"] is None


def test_the_pipeline_panel_offers_only_the_schedules_it_simulates():
    """zb-v and DualPipeV are estimated (lk.estimate) but not simulated here: not offered."""
    options = {c["name"]: c.get("options") for c in
               widgets.controls_spec(notebook_panel("pipeline_panel"))["controls"]}
    assert options["schedule"] == ["gpipe", "1f1b", "interleaved", "zb-h1"]
    form = its_form(notebook_panel("pipeline_panel"))
    for schedule in options["schedule"]:
        assert not web.panel_answer("pipeline_panel", form | {"schedule": schedule})["summary"].startswith("⚠")
