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
