"""The website calculator's Python side (labkit.course.web): the answers are labkit's own
estimate and planner, bad input comes back as the error that names the fix, and no torch is
needed (the page runs it under Pyodide; tests/browser/test_site_in_browser.py compares)."""
import json
import subprocess
import sys

import pytest

import labkit as lk
from labkit.course import web


def test_an_estimate_is_lk_estimates_by_category():
    got = web.estimate_answer(dict(model="deepseek-v2-lite", dp=8, ep=8, precision="bf16-master"))
    want = lk.estimate("deepseek-v2-lite", 1, 4096, precision="bf16-master",
                       layout=lk.Layout(dp=8, ep=8))
    assert got["total"] == want.total and got["explain"] == want.explain()
    assert got["categories"][2] == ["optimizer state", want.optimizer, lk.fmt_bytes(want.optimizer)]
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
    with pytest.raises(ValueError, match="'estimate' or 'plan'"):
        web.answer("estimates", "{}")


def test_a_plan_is_the_planners_without_its_clock():
    got = json.loads(web.answer("plan", json.dumps(dict(gpus=16, seq=8192))))
    want = lk.course.plan.plan("llama-3-8b", "h100-80gb", 16, seq=8192, top=10).as_dict()
    assert got["fits"] == json.loads(json.dumps(want["fits"]))
    assert "search_s" not in got and "searched in" not in got["text"]


def test_the_calculator_imports_no_torch():
    code = ("import sys; from labkit.course import web; web.estimate_answer({}); "
            "web.plan_answer({'gpus': 8}); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
