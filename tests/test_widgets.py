"""The memory panel's callbacks are plain functions; impossible settings are explained, not raised."""
import pytest
import torch

import labkit as lk
from labkit.course import widgets
from labkit.predict.layers import layer_saved
from labkit.training.track import MemoryTracker
from labkit.transformer.attention import (SRAM_PER_SM, core, core_peak_bytes, hbm_accesses,
                                          hbm_ratio_all_l2_hits, hbm_ratio_tiles)
from labkit.transformer.generate import attention_kind, mla_reduction


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


def test_memory_panel_offers_8bit_adamw_and_shrinks_the_optimizer_state():
    panel = widgets.MemoryPanel(model="small", seq=512)
    fp32_moments = panel.result.estimate.optimizer
    panel.optimizer.value = "adamw-8bit"
    assert panel.result.estimate.optimizer < fp32_moments / 3       # 8 -> ~2 bytes per number


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
    counters = 4 * 33              # AdamW's fp32 step per flat ZeRO unit: the root and 32 blocks
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


# ---- lab 04: the ZeRO panel ---------------------------------------------------------------------
def _zero_estimate(model, stage, gpus, precision="bf16-master", offload=False, device="cuda",
                   seq=2048):
    return lk.estimate(model, 1, seq, precision=precision, device=device,
                       layout=lk.Layout(dp=gpus, zero_stage=stage, offload=offload))


def test_zero_report_equals_the_estimate_and_states_the_papers_volume():
    result = widgets.zero_report("llama-2-7b", precision="bf16-master", zero_stage=3, gpus=8)
    assert result.estimate == _zero_estimate("llama-2-7b", 3, 8)
    assert result.unsharded == lk.estimate("llama-2-7b", 1, 2048, precision="bf16-master")
    n, sent = lk.count_params("llama-2-7b").total, result.estimate.details["bytes sent per step"]
    assert sent / (2 * n) == pytest.approx(3 * 7 / 8, rel=1e-5)    # a ring's 7/8 of 3Ψ, bf16
    lines = result.summary().splitlines()
    assert lines[0].startswith("llama-2-7b, bf16-master AdamW, ZeRO-3 over 8 GPUs, batch 1 x "
                               "2048 tokens, CUDA defaults (foreach AdamW")
    assert lines[2] == (f"each rank sends {lk.fmt_bytes(sent)} per step = 2.62 Ψ x 2 B (the "
                        "paper's 3Ψ; a ring sends (N-1)/N = 7/8 of it)")
    ddp = widgets.zero_report("llama-2-7b", precision="bf16-master", zero_stage=0, gpus=8)
    assert "= 1.75 Ψ x 2 B (the paper's 2Ψ" in ddp.summary()


def test_zero_stage_gpus_and_offload_change_each_ranks_bars():
    panel = widgets.ZeroPanel(model="llama-2-7b", precision="bf16-master", zero_stage=0, gpus=8)
    assert [c.description for c in (panel.model, panel.precision, panel.zero_stage,
                                    panel.gpus)] == ["model", "precision", "ZeRO stage", "GPUs"]
    assert panel.model.options[:3] == ("tiny", "small", "tiny-moe")

    def bars():
        return panel.result.estimate, panel.output.outputs[1]["data"]["image/png"]
    ddp, ddp_png = bars()
    panel.zero_stage.value = 3
    zero3, zero3_png = bars()
    assert zero3.model_states < ddp.model_states / 4 and zero3_png != ddp_png
    assert panel.result.unsharded == lk.estimate("llama-2-7b", 1, 2048, precision="bf16-master")
    panel.gpus.value = 64
    assert panel.result.estimate.model_states < zero3.model_states
    assert panel.result.estimate == _zero_estimate("llama-2-7b", 3, 64)
    panel.offload.value = True                           # the shards go to host memory
    offloaded = panel.result.estimate
    assert offloaded == _zero_estimate("llama-2-7b", 3, 64, offload=True)
    assert offloaded.total < _zero_estimate("llama-2-7b", 3, 64).total
    assert (f"in host memory per rank {lk.fmt_bytes(offloaded.details['host memory'])}"
            in panel.output.outputs[0]["text"])


def test_offload_without_zero_is_explained_not_raised():
    result = widgets.zero_report("small", precision="fp32", zero_stage=0, gpus=2, offload=True)
    assert result.estimate is None
    assert result.summary() == ("⚠ offload=True keeps ZeRO's shards in host memory "
                                "(ZeRO-Offload): choose zero_stage 1, 2 or 3")
    panel = widgets.ZeroPanel(model="tiny", precision="fp32", zero_stage=1, gpus=2)
    assert not panel.button.disabled
    panel.offload.value = True
    panel.zero_stage.value = 0
    assert panel.output.outputs[0]["text"].startswith("⚠ offload=True")
    assert len(panel.output.outputs) == 1 and panel.button.disabled


def test_what_cannot_be_measured_here_is_explained_and_the_button_disabled():
    def reason(**step):
        return widgets.why_not_measurable(**{"model": "tiny", "precision": "fp32",
                                             "zero_stage": 2, "gpus": 2, **step})
    assert reason() is None and reason(zero_stage=0, precision="bf16-mixed") is None
    assert "choose a course model (tiny, small, tiny-moe)" in reason(model="llama-2-7b")
    assert "choose 2 or 4 GPUs" in reason(gpus=8)
    assert "choose one of those, or stage 0 (DDP)" in reason(precision="bf16-mixed")
    refused = widgets.zero_report("tiny", precision="bf16-mixed", zero_stage=2, gpus=2,
                                  measure=True)
    assert refused.measured is None and "not bf16-mixed" in refused.summary()
    panel = widgets.ZeroPanel(model="tiny", precision="fp32", zero_stage=2, gpus=2)
    assert not panel.button.disabled and panel.button.description == "measure on 2 local processes"
    panel.gpus.value = 8
    assert panel.button.disabled and "choose 2 or 4 GPUs" in panel.note.value


def test_a_failed_measurement_is_explained_and_the_estimate_kept(monkeypatch):
    from labkit.parallel import cluster

    def fails(*args, **kwargs):
        raise cluster.RankFailed(1, "Traceback (most recent call last):\n...\nValueError: boom")
    monkeypatch.setattr(cluster, "run", fails)
    panel = widgets.ZeroPanel(model="tiny", precision="fp32", zero_stage=2, gpus=2)
    panel.measure()
    assert panel.result.summary() == "⚠ measuring failed: ValueError: boom"
    assert panel.result.estimate is not None and not panel.button.disabled


def test_measuring_tiny_zero2_on_two_processes_matches_the_cpu_estimate():
    """One gloo run (~8 s). As in test_zero: now and then gloo lets go of a finished
    collective's buffer late and one rank's peak holds it too: the lowest rank within 3%."""
    panel = widgets.ZeroPanel(model="tiny", precision="fp32", zero_stage=2, gpus=2)
    notes = []
    panel.note.observe(lambda change: notes.append(change["new"]), names="value")
    result = panel.measure()
    assert notes[0].startswith("measuring 3 steps on 2 local processes")
    assert result.error is None and len(result.measured) == 2
    cpu = _zero_estimate("tiny", 2, 2, precision="fp32", device="cpu", seq=32)
    assert result.cpu == cpu
    peaks = [r.peak for r in result.measured]
    assert min(peaks) == pytest.approx(cpu.total, rel=0.03)
    largest = 4 * cpu.details["largest unit (elements)"]    # a buffer gloo let go of late
    assert max(peaks) <= 1.03 * cpu.total + largest
    assert all(sum(r.sent.values()) == cpu.details["bytes sent per step"] for r in result.measured)
    text = panel.output.outputs[0]["text"]
    assert "measured on 2 local processes (gloo, last of 3 steps)" in text
    assert f"off by {100 * (cpu.total - max(peaks)) / max(peaks):+.2f}% (max over ranks)" in text
    assert [o["output_type"] for o in panel.output.outputs] == ["stream", "display_data",
                                                                "display_data"]
    assert not panel.button.disabled


def test_zero_panel_survives_a_rerun():
    for _ in range(2):                                   # a notebook cell run twice
        panel = widgets.ZeroPanel(model="small", precision="bf16-master", zero_stage=1, gpus=4)
        states = panel.result.estimate.model_states
        panel.zero_stage.value = 2
        assert panel.result.estimate.model_states < states
        assert "ZeRO-2 over 4 GPUs" in panel.output.outputs[0]["text"]
    assert isinstance(widgets.zero_panel(model="tiny"), widgets.w.VBox)


# ---- lab 05: the pipeline panel -----------------------------------------------------------------
def _pipeline_estimate(model="llama-2-7b", tp=2, pp=4, m=8, schedule="1f1b", v=1, sp=False,
                       seq=2048):
    return lk.estimate(lk.preset(model), 1, seq, precision="bf16-master", device="cuda",
                       layout=lk.Layout(tp=tp, sp=sp, pp=pp, micro_batches=m, schedule=schedule,
                                        virtual_stages=v))


def test_pipeline_report_shows_the_estimates_stages_and_1f1bs_in_flight_micro_batches():
    result = widgets.pipeline_report("llama-2-7b", tp=2, pp=4, micro_batches=8, schedule="1f1b")
    est = _pipeline_estimate()
    assert result.estimate == est and result.stages == est.details["stages"]
    assert len(result.stages) == 4 and max(s["total"] for s in result.stages) == est.total
    assert result.in_flight == [4, 3, 2, 1]
    assert result.summary().splitlines()[0] == (
        "llama-2-7b, tp=2 x pp=4 = 8 GPUs, 1f1b; batch = micro-batch size 1 x m = 8 sequences "
        "of 2048 tokens")
    one = widgets.pipeline_report("small", tp=1, pp=1, micro_batches=2, schedule="1f1b")
    assert one.stages[0]["total"] == one.estimate.total == _pipeline_estimate(
        "small", tp=1, pp=1, m=2).total


@pytest.mark.parametrize("schedule,p,m", [("gpipe", 4, 8), ("1f1b", 4, 2), ("1f1b", 8, 8),
                                          ("interleaved", 4, 8), ("zb-h1", 4, 8)])
def test_pipeline_idle_fraction_is_the_papers_formula(schedule, p, m):
    result = widgets.pipeline_report("llama-2-7b", tp=1, pp=p, micro_batches=m,
                                     schedule=schedule)
    v = 2 if schedule == "interleaved" else 1
    formula = (p - 1) / ((3 * m if schedule == "zb-h1" else v * m) + p - 1)
    assert float(result.timeline.idle_fraction) == pytest.approx(formula, abs=1e-12)
    assert result.bubble == pytest.approx(formula, abs=1e-12)
    assert (result.timeline.p, result.timeline.m, result.timeline.v) == (p, m, v)
    # the micro-batches the estimate keeps per stage are what the simulated schedule holds
    from fractions import Fraction
    assert result.in_flight == [Fraction(h, v) for h in result.timeline.held]
    assert f"simulated {formula:.1%}, formula" in result.summary()


def test_zb_h1_with_fewer_micro_batches_than_stages_names_the_formulas_assumption():
    result = widgets.pipeline_report("llama-2-7b", tp=1, pp=4, micro_batches=2,
                                     schedule="zb-h1")
    assert float(result.timeline.idle_fraction) > result.bubble == pytest.approx(1 / 3)
    assert result.summary().endswith("= 33.3% (it assumes m >= p)")


def test_pp_schedule_and_micro_batches_change_the_pipeline_report():
    def report(**change):
        return widgets.pipeline_report(**{"model": "llama-2-7b", "tp": 2, "pp": 4,
                                          "micro_batches": 8, "schedule": "1f1b", **change})
    base = report()
    deeper, gpipe, more = report(pp=8), report(schedule="gpipe"), report(micro_batches=16)
    assert deeper.estimate.total < base.estimate.total and len(deeper.stages) == 8
    first = base.stages[0]["saved_activations"]
    assert gpipe.stages[0]["saved_activations"] > 1.9 * first          # 8 in flight, not 4
    assert gpipe.in_flight == [8] * 4 and gpipe.bubble == base.bubble
    assert more.bubble < base.bubble and more.stages[0]["saved_activations"] == first
    assert report(sp=True).estimate.total < base.estimate.total
    assert report(seq=4096).estimate.total > base.estimate.total


def test_impossible_pipelines_are_explained_not_raised():
    def error(model="small", **change):
        return widgets.pipeline_report(model, **{"tp": 2, "pp": 2, "micro_batches": 4,
                                                 "schedule": "1f1b", **change}).summary()
    assert error(schedule="interleaved", pp=3, micro_batches=4, model="llama-2-7b") == (
        "⚠ interleaved 1F1B runs micro-batches in groups of pp=3: choose micro_batches among "
        "the multiples of 3")
    assert error(schedule="interleaved", pp=3, micro_batches=6) == (
        "⚠ interleaved 1F1B gives each GPU 2 chunks of at least one layer: choose pp <= 2 for "
        "small's 4 layers")
    assert error(tp=1, sp=True).startswith("⚠ sequence parallelism (sp=True)")
    assert "choose tp among the divisors of 8" in error(tp=3)
    assert error(schedule="interleaved", pp=2, micro_batches=4).startswith("small, tp=2")


def test_pipeline_panel_reacts_to_its_controls():
    panel = widgets.PipelinePanel()
    assert [c.description for c in (panel.model, panel.tp, panel.pp, panel.micro_batches,
                                    panel.schedule, panel.seq)] == [
        "model", "tp", "pp", "micro-batches", "schedule", "seq"]
    assert panel.tp.options == (1, 2, 4, 8) and panel.pp.max == 16
    outputs = panel.output.outputs
    assert [o["output_type"] for o in outputs] == ["stream", "display_data", "display_data"]
    panel.schedule.value = "gpipe"                          # every stage holds all 8
    assert "in flight per stage: 8, 8, 8, 8" in panel.output.outputs[0]["text"]
    assert panel.output.outputs[2]["data"] != outputs[2]["data"]      # another Gantt chart
    panel.schedule.value = "interleaved"
    panel.pp.value = 3                                       # 8 micro-batches in groups of 3
    assert panel.output.outputs[0]["text"].startswith("⚠ interleaved 1F1B runs micro-batches")
    assert len(panel.output.outputs) == 1
    panel.pp.value, panel.micro_batches.value = 16, 32       # 512 ops a row: no Gantt chart
    assert "Gantt chart is drawn for p x m <= 256; here 16 x 32 = 512" in (
        panel.output.outputs[0]["text"])
    assert len(panel.output.outputs) == 2
    panel.schedule.value = "1f1b"
    panel.model.value = "tiny"                               # 4 heads, 2 layers
    assert panel.tp.options == (1, 2, 4) and panel.tp.value == 2
    assert panel.pp.value == panel.pp.max == 2
    assert panel.result.estimate == _pipeline_estimate("tiny", pp=2, m=32)
    assert isinstance(widgets.pipeline_panel(model="small", tp=1), widgets.w.VBox)


def test_pipeline_panels_default_pp_leaves_the_browser_test_a_step_on_every_model():
    for model, pp in (("tiny", 1), ("small", 2), ("llama-2-7b", 4)):
        panel = widgets.PipelinePanel(model=model)
        assert panel.pp.value == pp < panel.pp.max
        panel.schedule.value = "zb-h1"                  # PANEL_CONTROLS' option, then pp + 1
        before = panel.output.outputs
        panel.pp.value += 1
        assert panel.result.error is None and panel.output.outputs != before


# ---- lab 06: quantisation panel -------------------------------------------------------------------
SEVEN_B_PARAMS = 6_738_415_616                          # llama-2-7b, count_params(...).total




@pytest.mark.parametrize("setting, nbytes", [
    (("nf4", 4, 64, True), 256 * 1024 // 2 + 4096 + 16 * 4 + 4),   # codes, int8 scales, dq, mean
    (("nf4", 4, 64, False), 256 * 1024 // 2 + 4096 * 4),           # codes, fp32 scales
    (("int8 absmax", 8, "channel"), 256 * 1024 + 256 * 4),
    (("int8 zero-point", 8, 128), 256 * 1024 + 2048 * 5),         # fp32 scale + uint8 zero
    (("rtn", 4, 64), 256 * 1024 // 2 + 4096 * 2 + 4096 // 2),     # fp16 scale, 4-bit zero
    (("gptq", 3, 128), 256 * 1024 * 3 // 8 + 2048 * 2 + 2048 * 3 // 8),
])
@pytest.mark.usefixtures("one_thread")
def test_quant_report_bits_per_parameter_are_the_stored_bytes(setting, nbytes):
    result = widgets.quant_report(*setting)
    assert result.error is None and (result.nbytes, result.numel) == (nbytes, 256 * 1024)
    assert result.bits_per_param == 8 * nbytes / (256 * 1024)
    assert result.model_bytes == pytest.approx(SEVEN_B_PARAMS * result.bits_per_param / 8)
    assert f"{result.bits_per_param:.4f} bits" in result.summary()


@pytest.mark.usefixtures("one_thread")
def test_quant_report_errors_sit_where_the_grids_put_them():
    report = {s: widgets.quant_report(*s) for s in [
        ("int8 absmax", 8, "tensor"), ("int8 absmax", 8, "channel"), ("nf4", 4, 64, True),
        ("nf4", 4, 64, False), ("rtn", 4, 64), ("gptq", 4, 64), ("rtn", 2, 64)]}
    int8_tensor, int8_channel, nf4_dq, nf4, rtn4, gptq4, rtn2 = report.values()
    # absmax int8 on N(0, s): step ~ 3.3 s / 127 (channel max), rounding error step / sqrt(12)
    assert 0.006 < int8_channel.weight_error < 0.009 < int8_tensor.weight_error < 0.012
    # measured: NF4 b64 0.092, RTN int4 g64 0.091; double quantisation costs < 0.1% of it
    assert 0.085 < nf4.weight_error < 0.1 and 0.085 < rtn4.weight_error < 0.1
    assert nf4_dq.weight_error == pytest.approx(nf4.weight_error, rel=1e-3)
    assert nf4_dq.bits_per_param < nf4.bits_per_param
    assert rtn2.weight_error > 4 * rtn4.weight_error
    # GPTQ moves the weights further (0.108) and the outputs much less: measured 0.19 of RTN's
    assert gptq4.weight_error > rtn4.weight_error
    assert gptq4.output_error < 0.3 * rtn4.output_error
    assert "calibrated on 1024 other seeded inputs" in gptq4.summary()


@pytest.mark.parametrize("setting, message", [
    (("nf4", 3, 64), "nf4 stores 4-bit codes: set bits to 4"),
    (("int8 absmax", 4, 64), "int8 absmax stores 8-bit codes: set bits to 8"),
    (("rtn", 4, "channel"), "one scale per channel is an int8 option here"),
    (("gptq", 4, 64, True), "double quantisation stores NF4's block scales"),
    (("rtn", 1, 64), "bits must lie in 2..8"),
    (("int4", 4, 64), "unknown scheme 'int4'"),
    (("nf4", 4, 48), "block=48 does not divide the 262144 values"),
    (("gptq", 4, 48), "group=48 must divide the 1024 input columns"),
])
@pytest.mark.usefixtures("one_thread")
def test_impossible_quant_settings_are_explained_not_raised(setting, message):
    result = widgets.quant_report(*setting)
    assert message in result.error and result.summary().startswith("⚠")


@pytest.mark.usefixtures("one_thread")
def test_quant_report_takes_any_weight_and_explains_one_it_cannot_block():
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    result = widgets.quant_report("nf4", 4, 64, False, weight=weight)
    assert result.numel == 64 * 128 and result.nbytes == 64 * 128 // 2 + 128 * 4
    assert "block=64 does not divide the 1000 values" in widgets.quant_report(
        "nf4", 4, 64, weight=torch.ones(10, 100)).error


@pytest.mark.usefixtures("one_thread")
def test_quant_panel_reacts_to_its_controls():
    panel = widgets.QuantPanel()
    assert [c.description for c in (panel.scheme, panel.bits, panel.block)] == [
        "scheme", "bits", "block"]
    assert panel.result.label == "nf4 b64 dq" and not panel.double_quant.disabled
    outputs = panel.output.outputs
    assert [o["output_type"] for o in outputs] == ["stream", "display_data"]
    panel.scheme.value = "rtn"                              # bits stay 4: rtn int4 g64
    assert panel.output.outputs[0]["text"].startswith("rtn int4 g64: 141,312 bytes")
    assert panel.double_quant.disabled and panel.output.outputs[1]["data"] != outputs[1]["data"]
    panel.bits.value = 3
    assert panel.result.label == "rtn int3 g64"
    panel.scheme.value = "int8 absmax"                      # bits set to 8, per-row scales offered
    assert panel.bits.value == 8 and "channel" in panel.block.options
    panel.block.value = "channel"
    assert panel.result.bits_per_param == 8 + 32 / 1024
    panel.scheme.value = "nf4"                              # "channel" is not an NF4 block
    assert (panel.bits.value, panel.block.value, panel.result.label) == (4, 64, "nf4 b64 dq")
    panel.bits.value = 5
    assert panel.output.outputs[0]["text"].startswith("⚠ nf4 stores 4-bit codes")
    assert len(panel.output.outputs) == 1
    assert isinstance(widgets.quant_panel(scheme="gptq", bits=3), widgets.w.VBox)
    assert widgets.QuantPanel(scheme="int8 zero-point").result.bits_per_param == 8 + 40 / 64
    with pytest.raises(ValueError, match="unknown block for nf4 'channel'"):
        widgets.QuantPanel(block="channel")


# ---- lab 07: the attention core and the KV cache -------------------------------------------
def _core_peak_in_a_models_layout(impl, seq, heads, head_dim):
    """Peak bytes of one bf16 fwd + bwd of ``impl`` beyond q, k, v and dO, with q, k, v made as
    a model makes them: (1, T, H, d) projections viewed as (1, H, T, d)."""
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(1, seq, heads, head_dim, generator=g).bfloat16().requires_grad_()
              for _ in range(3)]
    grad_out = torch.randn(1, heads, seq, head_dim, generator=g).bfloat16()
    with MemoryTracker(timeline=False) as mt:
        for t in (*leaves, grad_out):
            mt.tag(t, "other")
        before = mt.current
        mt.reset_peak()
        q, k, v = (x.transpose(1, 2) for x in leaves)                     # (1, H, T, d) views
        core(impl)(q, k, v).backward(grad_out)
    return mt.peak - before


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("impl", ["naive", "sdpa", "tiled"])
@pytest.mark.parametrize("seq, heads, head_dim", [(256, 4, 64), (512, 8, 32), (2048, 4, 64)])
def test_attention_core_formula_is_the_measured_peak(impl, seq, heads, head_dim):
    """Tiled: a tile inside the loop at 256 and 512 tokens, the backward's end at 2,048."""
    predicted = widgets.attention_core_bytes(impl, seq, heads, head_dim)
    assert predicted.peak == _core_peak_in_a_models_layout(impl, seq, heads, head_dim)


@pytest.mark.usefixtures("one_thread")
def test_on_leaf_inputs_sdpa_adds_one_gradient_copied_into_the_leafs_layout():
    """core_peak_bytes makes q, k, v (1, H, T, d) leaves: the CPU kernel writes their gradients
    (1, T, H, d)-major, and autograd copies each into its leaf once the kernel's saved
    tensors (the log-sum-exp) are freed. Naive and tiled peak elsewhere: the same bytes."""
    T, H, d = 512, 4, 64
    sdpa = widgets.attention_core_bytes("sdpa", T, H, d)
    copy, lse = T * H * d * 2, 4 * H * T
    assert core_peak_bytes("sdpa", T, H, d, dtype=torch.bfloat16) == sdpa.peak - lse + copy
    for impl in ("naive", "tiled"):
        assert core_peak_bytes(impl, T, H, d, dtype=torch.bfloat16) == \
            widgets.attention_core_bytes(impl, T, H, d).peak


def test_kept_bytes_are_the_layers_terms_less_q_k_v():
    T, H, d = 2048, 32, 128
    cfg = lk.preset("llama-2-7b")                                        # 32 heads x 128, MHA
    kept = {impl: widgets.attention_core_bytes(impl, T, H, d) for impl in ("naive", "sdpa")}
    assert kept["sdpa"].kept == {"attention output (wo's input)": T * H * d * 2,
                                 "attention log-sum-exp": 4 * H * T}
    # an fp32 softmax and the bf16 copy its matmul with v keeps (transformers' eager attention)
    assert kept["naive"].kept["attention probabilities (T x T per head)"] == 6 * H * T * T
    layer = {impl: layer_saved(cfg, "bf16", attention=impl).bytes(1, T) for impl in kept}
    assert (layer["naive"] - layer["sdpa"] == kept["naive"].kept_total
            - kept["sdpa"].kept_total)
    tiled = widgets.attention_core_bytes("tiled", T, H, d)
    assert tiled.kept == kept["sdpa"].kept                     # what SDPA's flash kernel keeps


def test_naive_peak_grows_as_seq_squared_sdpa_and_tiled_as_seq():
    T, H, d = 16384, 32, 128
    peak = {impl: [widgets.attention_core_bytes(impl, n, H, d).peak for n in (T, 2 * T)]
            for impl in ("naive", "sdpa", "tiled")}
    naive, sdpa, tiled = peak.values()
    # a T^2 + b T doubled: the T^2 part (P, dP, dS: 3 x 4 bytes per head and pair) quadruples
    assert naive[1] - 2 * naive[0] == 2 * (3 * 4 * H) * T * T
    assert naive[1] / naive[0] == pytest.approx(4, rel=0.01)
    assert sdpa[1] == 2 * sdpa[0]
    assert tiled[1] == 2 * tiled[0]     # long: its peak is the backward's end, the tiles freed


def test_attention_report_numbers_are_labkits():
    r = widgets.attention_report("tiled", seq=4096, heads=32, head_dim=128, model="mistral-7b",
                                 context=32768, batch=4)
    cfg = lk.preset("mistral-7b")
    assert r.error is None and r.core == widgets.attention_core_bytes("tiled", 4096, 32, 128)
    assert r.cache == lk.kv_cache_bytes(cfg, 4, 32768) == 16 * 2**30
    assert (r.kind, r.mha_cache) == ("GQA", lk.kv_cache_bytes(cfg.replace(kv_heads=32), 4, 32768))
    for gpu, ratio in r.hbm.items():
        sram = SRAM_PER_SM[gpu].per_sm
        assert ratio == hbm_accesses(4096, 128, sram, "naive") / hbm_accesses(4096, 128, sram,
                                                                                "tiled")
    assert r.hbm_tiles == hbm_ratio_tiles(4096, 128) == hbm_accesses(4096, 128, 1, "naive") / \
        hbm_accesses(4096, 128, 1, "tiled", block=128)              # 128-row tiles, any GPU
    assert r.hbm_l2 == hbm_ratio_all_l2_hits(4096, 128)             # every re-read an L2 hit
    assert "2.0x in 128-row tiles" in r.summary() and "L2: 32.9x" in r.summary()
    assert "GQA: 8 kv heads for 32 query heads" in r.summary()
    mla = widgets.attention_report("sdpa", seq=512, heads=128, head_dim=192, model="deepseek-v2",
                                   context=4096)
    assert mla.kind == attention_kind(lk.preset("deepseek-v2")) == "MLA"
    assert mla.mha_cache / mla.cache == mla_reduction("deepseek-v2").ratio
    mqa = widgets.attention_report("sdpa", seq=512, heads=32, head_dim=128, model="mistral-7b",
                                   context=4096, kv_heads=1)
    assert (mqa.kind, mqa.mha_cache // mqa.cache) == ("MQA", 32)


@pytest.mark.parametrize("change, message", [
    ({"seq": 0}, "seq must be a positive integer, got 0"),
    ({"heads": -1}, "heads must be a positive integer"),
    ({"impl": "flash"}, "unknown attention implementation 'flash'"),
    ({"context": 0}, "context (tokens in the KV cache) must be a positive integer"),
    ({"kv_heads": 5}, "kv_heads=5 does not divide heads=32"),
])
def test_impossible_attention_settings_are_explained_not_raised(change, message):
    setting = {**dict(impl="naive", seq=1024, heads=32, head_dim=128, model="llama-2-7b",
                      context=4096), **change}
    result = widgets.attention_report(setting.pop("impl"), **setting)
    assert message in result.error and result.summary().startswith("⚠")


def test_attention_panel_reacts_to_its_controls_and_sets_its_output_as_state():
    panel = widgets.AttentionPanel()
    assert [c.description for c in (panel.impl, panel.seq, panel.heads, panel.head_dim,
                                    panel.model, panel.kv_heads, panel.context)] == [
        "implementation", "seq", "heads", "head dim", "model", "kv heads", "context"]
    outputs = panel.output.outputs
    assert [o["output_type"] for o in outputs] == ["stream", "display_data"]
    assert outputs[0]["text"].startswith("sdpa attention core, one layer, batch 1, bf16, 32 heads")
    panel.impl.value = "naive"
    text = panel.output.outputs[0]["text"]
    assert text.startswith("naive") and "attention probabilities (T x T per head) 3.00 GiB" in text
    panel.seq.value += panel.seq.step                                    # 4096 -> 4608
    assert panel.result.core.peak == widgets.attention_core_bytes("naive", 4608, 32, 128).peak
    assert panel.output.outputs[0]["text"] != text
    panel.model.value = "deepseek-v2"                    # loads its heads, q.k width; MLA cache
    assert (panel.heads.value, panel.head_dim.value, panel.kv_heads.disabled) == (128, 192, True)
    assert panel.result.kind == "MLA"
    panel.model.value = "mistral-7b"
    panel.kv_heads.value = 5
    assert [o["output_type"] for o in panel.output.outputs] == ["stream"]
    assert panel.output.outputs[0]["text"].startswith("⚠ kv_heads=5 does not divide heads=32")
    panel.kv_heads.value = 8
    panel.context.value = 8192
    assert panel.result.cache == lk.kv_cache_bytes("mistral-7b", 1, 8192)
    assert isinstance(widgets.attention_panel(impl="tiled", seq=1024), widgets.w.VBox)


def test_allocator_panel_replays_two_steps_under_each_setting():
    """Lab 08's panel: the tensors' peak from the tracker and, for each allocator setting, what
    it reserves - never less than the blocks it hands out; bad input is explained."""
    from labkit.course.widgets import ALLOCATORS, allocator_report
    r = allocator_report("tiny", batch=2, seq=32, allocator="expandable segments")
    assert set(r.replays) == set(ALLOCATORS)
    for run in r.replays.values():
        assert run.peak_reserved >= run.peak_allocated >= r.tracker_peak
    assert r.summary().splitlines()[1].startswith("expandable segments: the allocator reserves")
    assert "batch must be a positive integer" in allocator_report("tiny", batch=0, seq=32).summary()
    assert "unknown allocator" in allocator_report("tiny", batch=1, seq=32,
                                                   allocator="cudaMallocAsync").summary()


def test_plan_panel_shows_the_fastest_layouts_and_explains_bad_input():
    """Lab 09's panel: the planner's layouts for the chosen cluster, a GPU type's memory changes
    what is usable, and an unknown GPU is explained instead of raised."""
    from labkit.course.widgets import PlanPanel, plan_report
    panel = PlanPanel(model="small", gpu="a100-80gb", gpus=2, seq=512)
    first = panel.result.summary()
    assert first.startswith("small on 2 x a100-80gb, seq 512:") and "#1" in first
    panel.gpu.value = "l4-24gb"
    assert "21.59 GiB usable" not in first and "usable" in panel.result.summary()
    assert panel.result.summary() != first
    assert "unknown GPU 'nope'" in plan_report("small", gpu="nope", gpus=1, seq=512).summary()
