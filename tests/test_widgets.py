"""The memory panel's callbacks are plain functions; impossible settings are explained, not raised."""
import labkit as lk
from labkit import widgets


def test_predict_returns_the_same_estimate_as_the_library():
    result = widgets.predict("small", batch=1, seq=512, precision="fp32", optimizer="adamw")
    assert result.error is None
    assert result.estimate.total == lk.estimate("small", seq=512, precision="fp32").total


def test_changing_the_shape_changes_the_model():
    result = widgets.predict("small", batch=1, seq=512, precision="fp32", optimizer="adamw",
                             layers=8, hidden=512)
    assert (result.config.layers, result.config.hidden) == (8, 512)
    assert result.config.head_dim == 512 // result.config.heads


def test_impossible_shape_is_explained_not_raised():
    result = widgets.predict("small", batch=1, seq=512, precision="fp32", optimizer="adamw",
                             heads=7)
    assert result.estimate is None
    assert "heads=7 does not divide hidden=256" in result.error
    assert result.summary().startswith("⚠")


def test_predict_and_measure_agree_on_fake_tensors():
    result = widgets.predict_and_measure("tiny", batch=1, seq=256, precision="bf16-mixed",
                                         optimizer="adamw")
    assert result.measurement.fake
    assert abs(result.estimate.total - result.measurement.total) < 0.03 * result.measurement.total
    assert "measured peak" in result.summary()


def test_panel_updates_when_a_control_changes_and_survives_a_rerun():
    for _ in range(2):                                   # a notebook cell run twice
        panel = widgets.MemoryPanel(model="small", seq=512)
        before = panel.result.estimate.total
        panel.seq.value = 1024
        assert panel.result.estimate.total > before
        panel.shape["heads"].value = 7
        assert panel.result.error and "heads=7" in panel.status.value


def test_choosing_a_preset_loads_its_shape():
    panel = widgets.MemoryPanel(model="small", seq=512)
    panel.model.value = "tiny"
    assert panel.shape["hidden"].value == lk.preset("tiny").hidden
    assert panel.result.config.name == "tiny"


def test_recompute_report_matches_the_estimate_and_explains_bad_input():
    result = widgets.recompute_report("small", layers=8, seq=512, batch=1, policy="full")
    assert result.estimate.total == lk.estimate(lk.preset("small", layers=8), seq=512,
                                                precision="bf16-mixed", recompute="full").total
    bad = widgets.recompute_report("small", layers=8, seq=512, batch=1, policy="half")
    assert "unknown recompute policy 'half'" in bad.error


def test_recompute_panel_updates_with_its_controls():
    panel = widgets.RecomputePanel(model="tiny", seq=256)
    full = panel.result.estimate.saved_activations
    panel.policy.value = "none"
    assert panel.result.estimate.saved_activations > full


def test_panels_set_their_output_as_state_without_capturing_the_cell():
    panel = widgets.RecomputePanel(model="tiny", seq=256)
    outputs = panel.output.outputs
    assert outputs[0]["output_type"] == "stream" and "saved activations" in outputs[0]["text"]
    assert "image/png" in outputs[1]["data"]
    assert panel.output.msg_id == ""              # never switched to the cell's message
    memory = widgets.MemoryPanel(model="small", seq=512)
    assert [o["output_type"] for o in memory.output.outputs] == ["display_data"]
    memory.shape["heads"].value = 7                # an error clears the plot
    assert memory.output.outputs == ()


def test_states_report_splits_each_state_as_zero_does():
    result = widgets.states_report("llama-2-7b", precision="bf16-master", optimizer="adamw",
                                   zero_stage=2, gpus=8)
    assert result.per_parameter == {"weights": (2, 1), "grads": (2, 8), "optimizer": (12, 8),
                                    "weight cache": (0, 1)}
    n = lk.count_params("llama-2-7b").total
    states = result.estimate.details["model states"]
    counters = 4 * 291                                   # AdamW's fp32 step per weight tensor
    assert states == {"params": 2 * n, "grads": 2 * n // 8, "optimizer": 12 * n // 8 + counters}
    assert sum(states.values()) == lk.model_state_bytes(n, "bf16-master", "adamw", 2, 8) + counters
    assert result.summary().splitlines()[:3] == [
        "llama-2-7b, bf16-master adamw, ZeRO-2 over 8 GPUs. Bytes per parameter on one GPU:",
        "  weights 2 + gradients 2/8 + optimizer state 12/8 = 3.75 (one GPU without ZeRO: 16)",
        "model states per GPU: 23.53 GiB (one GPU without ZeRO: 100.41 GiB)"]


def test_states_report_per_parameter_times_params_is_the_zero_papers_formula():
    from fractions import Fraction
    n, K, Nd = lk.count_params("llama-2-7b").total, 12, 64
    paper = [(2 + 2 + K) * n, (2 + 2 + Fraction(K, Nd)) * n, (2 + Fraction(2 + K, Nd)) * n,
             Fraction(2 + 2 + K, Nd) * n]
    for stage, formula in enumerate(paper):
        result = widgets.states_report("llama-2-7b", precision="bf16-master", optimizer="adamw",
                                       zero_stage=stage, gpus=Nd)
        assert sum(result.per_gpu(s) for s in widgets.STATES) * n == formula


def test_states_report_names_autocasts_unsharded_copies_and_explains_bad_input():
    mixed = widgets.states_report("small", precision="bf16-mixed", optimizer="adamw",
                                  zero_stage=3, gpus=4)
    assert mixed.per_parameter["weight cache"] == (2, 1)
    assert "bf16 weight copies 2 per matmul weight, not sharded" in mixed.summary()
    assert mixed.estimate.saved_weight_cache == mixed.unsharded.saved_weight_cache > 0
    bad = widgets.states_report("small", precision="bf16-mixed", optimizer="adamw",
                                zero_stage=4, gpus=4)
    assert bad.estimate is None and "zero_stage must be 0, 1, 2 or 3" in bad.summary()


def test_states_panel_controls_have_their_labels_and_change_the_output():
    panel = widgets.StatesPanel(model="small", precision="bf16-master", zero_stage=0, gpus=8)
    assert [c.description for c in (panel.model, panel.precision, panel.optimizer,
                                    panel.zero_stage, panel.gpus)] == [
        "model", "precision", "optimizer", "ZeRO stage", "GPUs"]
    before = panel.output.outputs[0]["text"]
    states = sum(panel.result.estimate.details["model states"].values())
    panel.zero_stage.value = 3
    assert sum(panel.result.estimate.details["model states"].values()) < states
    assert panel.output.outputs[0]["text"] != before and "ZeRO-3 over 8 GPUs" in panel.output.outputs[0]["text"]
    assert "image/png" in panel.output.outputs[1]["data"]
    panel.gpus.value = 1                                   # ZeRO over one GPU splits nothing
    assert sum(panel.result.estimate.details["model states"].values()) == states
