"""Pipeline schedules (labkit.parallel.pipeline.schedules) and the executor
(labkit.parallel.pipeline.pipeline_parallel):
every op once in a possible order, the papers' bubbles, and real stages on gloo that equal one
process and hold the activations the schedule says."""
import dataclasses
from fractions import Fraction

import pytest
import torch
from matplotlib.colors import to_rgba

from labkit.core.config import preset
from labkit.course.plot import OP_COLORS, gantt_figure
from labkit.parallel.cluster import RankContext
from labkit.parallel.pipeline.pipeline_parallel import (build_chunks, chunk_layers, in_flight,
                                                        measure_schedules, micro_batch_terms,
                                                        micro_batches, one_process_step,
                                                        predicted_held, run_schedules)
from labkit.parallel.pipeline.torch_runtime import compare_with_torch, torch_pipelining
from labkit.parallel.pipeline.schedules import (Op, Schedule, make_schedule, measured_durations,
                                                simulate, validate, zb_h1_bubble)
from labkit.predict.layers import head_saved, layer_saved
from labkit.predict.papers import pipeline_bubble

CFG = dataclasses.replace(preset("tiny"), layers=4)     # 4 layers: 2 or 4 stages, v = 2 at p = 2
M, B, T = 4, 1, 16                                     # micro-batches of B rows of T tokens
CASES = {2: [("gpipe", M, 1), ("1f1b", M, 1), ("zb-h1", M, 1), ("interleaved", M, 2)],
         4: [("gpipe", M, 1), ("1f1b", M, 1), ("zb-h1", M, 1)]}
# one process sums the micro-batches' gradients in the same order: equal to fp32 round-off
# (bit-identical on this machine; another thread count could reorder a matmul's sums)
TOL = dict(rtol=1e-5, atol=1e-7)


def every_schedule(ps=(1, 2, 3, 4, 6), ms=range(1, 13)):
    for name in ("gpipe", "1f1b", "zb-h1", "interleaved"):
        for p in ps:
            for m in ms:
                for v in ((1, 2, 3) if name == "interleaved" else (1,)):
                    if name != "interleaved" or m % p == 0:
                        yield name, p, m, v


# ---- the op lists --------------------------------------------------------------------------------
def test_every_schedule_runs_each_op_once_in_an_order_the_stages_can_follow():
    for name, p, m, v in every_schedule():
        schedule = make_schedule(name, p, m, v)             # validate() raises otherwise
        kinds = 3 if name == "zb-h1" else 2
        assert [len(ops) for ops in schedule.stages] == [kinds * m * v] * p


def test_a_backward_before_its_forward_is_refused():
    ops = (Op("B", 0), Op("F", 0))
    with pytest.raises(ValueError, match=r"stage 0 runs B0 before F0"):
        validate(Schedule("bad", 1, 1, 1, (ops,)))


def test_a_missing_op_is_named():
    with pytest.raises(ValueError, match=r"missing \['B1'\]"):
        validate(Schedule("bad", 1, 2, 1, ((Op("F", 0), Op("F", 1), Op("B", 0)),)))


def test_stages_that_wait_on_each_other_forever_are_a_deadlock():
    first = (Op("F", 0), Op("B", 0), Op("F", 1), Op("B", 1))
    second = (Op("F", 1), Op("B", 1), Op("F", 0), Op("B", 0))   # wants F1 before stage 0 sends it
    with pytest.raises(ValueError, match=r"deadlocks.*\{0: 'B0', 1: 'F1'\}"):
        validate(Schedule("bad", 2, 2, 1, (first, second)))


@pytest.mark.parametrize("call, message", [
    (lambda: make_schedule("zb", 2, 4), r"unknown schedule 'zb'; use one of gpipe, 1f1b"),
    (lambda: make_schedule("1f1b", 2, 4, v=2), r"v=2 chunks per stage needs schedule='interl"),
    (lambda: make_schedule("interleaved", 4, 6, v=2), r"rounds of p=4: choose m a multiple of 4"),
    (lambda: make_schedule("gpipe", 0, 4), r"p must be a positive integer, got 0"),
    (lambda: simulate(make_schedule("gpipe", 2, 2), {"X": 1}), r"op kinds F, B and W; got \['X'\]"),
    (lambda: chunk_layers(4, 4, 2), r"4 stages x 2 chunks need at least 8 layers \(got 4\)"),
    (lambda: build_chunks(dataclasses.replace(CFG, tie_embeddings=True), 0, 2),
     r"tied embeddings .* use a config with tie_embeddings=False"),
    (lambda: run_schedules(RankContext(0, 1, None, torch.device("cpu")), CFG,
                           [("interleaved", 2, 2)]), r"run v > 1 on 2 or more ranks"),
    (lambda: torch_pipelining(RankContext(0, 2, None, torch.device("cpu")), CFG,
                              [("zb-h1", 4, 1)]), r"'zb-h1' has no counterpart"),
])
def test_bad_input_names_the_fix(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---- the simulator against the papers' formulas --------------------------------------------------
@pytest.mark.parametrize("durations", [None, {"F": 1, "B": 2, "W": 0}, {"F": 2, "B": 3, "W": 1}])
def test_gpipe_and_1f1b_idle_p_minus_1_over_m_plus_p_minus_1(durations):
    """Any equal F and backward on every stage: exactly (p-1)/(m+p-1), as papers.pipeline_bubble."""
    for name, p, m, _ in every_schedule():
        if name in ("gpipe", "1f1b"):
            idle = simulate(make_schedule(name, p, m), durations).idle_fraction
            assert idle == Fraction(p - 1, m + p - 1)
            assert float(idle) == pytest.approx(pipeline_bubble(p, m, name))


def test_interleaving_v_chunks_idles_p_minus_1_over_v_m_plus_p_minus_1():
    for name, p, m, v in every_schedule():
        if name == "interleaved":
            idle = simulate(make_schedule(name, p, m, v)).idle_fraction
            assert idle == Fraction(p - 1, v * m + p - 1)
            assert float(idle) == pytest.approx(pipeline_bubble(p, m, "interleaved", v))


def test_zb_h1_idles_a_third_of_1f1b_when_f_b_and_w_cost_the_same():
    """Qi et al.: (p-1)(T_F + T_B - T_W) of idle per stage against 1F1B's (p-1)(T_F + T_B + T_W),
    once there are at least p micro-batches."""
    for name, p, m, _ in every_schedule():
        if name == "zb-h1" and m >= p:
            timeline = simulate(make_schedule(name, p, m))
            assert timeline.idle_fraction == Fraction(p - 1, 3 * m + p - 1)
            assert float(timeline.idle_fraction) == pytest.approx(zb_h1_bubble(p, m))
            assert timeline.makespan - 3 * m == (p - 1)          # 1F1B: 3(p - 1)


def test_gpipe_holds_m_micro_batches_1f1b_p_minus_s_as_the_estimate_assumes():
    for name, p, m, _ in every_schedule():
        if name in ("gpipe", "1f1b"):
            assert make_schedule(name, p, m).peak_held() == [in_flight(s, p, m, name)
                                                             for s in range(p)]


def test_interleaved_and_zb_h1_hold_what_their_warm_up_starts():
    """Interleaved: 2(p-s-1) + (v-1)p + 1 chunks (each 1/v of the stage); ZB-H1: p on every
    stage, 1F1B's peak (its deferred W's keep a micro-batch's activations alive)."""
    for name, p, m, v in every_schedule():
        held = make_schedule(name, p, m, v).peak_held()
        if name == "interleaved":
            assert held == [min(m * v, 2 * (p - s - 1) + (v - 1) * p + 1) for s in range(p)]
        elif name == "zb-h1":
            assert held == [min(m, p)] * p


def test_measured_durations_give_back_the_simulated_timeline():
    schedule = make_schedule("zb-h1", 4, 8)
    timeline = simulate(schedule, {"F": 2, "B": 3, "W": 1})
    again = simulate(schedule, measured_durations(timeline))
    assert again.stages == timeline.stages


def test_gantt_draws_one_bar_per_op_coloured_by_kind():
    timeline = simulate(make_schedule("zb-h1", 4, 8))
    ax = gantt_figure(timeline).axes[0]
    spans = [span for stage in timeline.stages for span in stage]
    assert len(ax.patches) == len(spans) == 4 * 3 * 8
    for bar, span in zip(ax.patches, spans):
        assert (bar.get_x(), bar.get_width()) == (span.start, span.end - span.start)
        assert bar.get_facecolor() == to_rgba(OP_COLORS[span.op.kind])
    assert ax.patches[len(timeline.stages[0])].get_x() == 1       # stage 1 waits for F0
    assert "idle 11.1%" in ax.get_title()                             # 3/27


# ---- one process: the chunks are the model -------------------------------------------------------
def test_chunks_in_a_row_compute_the_models_loss():
    """Virtual stages 0..3 (p = 2, v = 2: stage 0 holds chunks 0 and 2) = the whole model."""
    from labkit.transformer.model import build_model
    (inputs, targets), = micro_batches(CFG, 1, 2, T)
    torch.manual_seed(0)
    whole = build_model(CFG)(inputs, targets)
    chunks = [build_chunks(CFG, s, 2, v=2)[0] for s in range(2)]
    x = inputs
    for c in range(2):
        for s in range(2):
            x = chunks[s][c](x, targets if (s, c) == (1, 1) else None)
    assert x.item() == whole.item()


def test_a_v_of_chunks_computes_the_models_loss():
    """ZB-V's placement: down the stages on chunk 0, back up on chunk 1 (stage 0 ends it)."""
    from labkit.transformer.model import build_model
    (inputs, targets), = micro_batches(CFG, 1, 2, T)
    torch.manual_seed(0)
    whole = build_model(CFG)(inputs, targets)
    chunks = [build_chunks(CFG, s, 2, v=2, placement="v")[0] for s in range(2)]
    x = inputs
    for s, c in ((0, 0), (1, 0), (1, 1), (0, 1)):
        x = chunks[s][c](x, targets if (s, c) == (0, 1) else None)
    assert x.item() == whole.item()
    with pytest.raises(ValueError, match="two chunks"):
        chunk_layers(8, 2, 3, placement="v")


# ---- real stages on gloo -------------------------------------------------------------------------
@pytest.fixture(scope="module", params=sorted(CASES))
def runs(request):
    p = request.param
    return p, measure_schedules(CFG, p, CASES[p], B, T, timeout_s=180)


@pytest.fixture(scope="module")
def reference():
    return one_process_step(CFG, M, B, T)


def test_every_schedule_gives_one_processs_losses_and_gradients(runs, reference):
    _, results = runs
    losses, grads = reference
    for run in results:
        assert run.losses == pytest.approx(losses, rel=1e-6), run.schedule.name
        assert run.grads.keys() == grads.keys()                  # every parameter, once
        for name, grad in grads.items():
            torch.testing.assert_close(run.grads[name], grad, **TOL, msg=name)


def test_each_stage_holds_the_predicted_activation_bytes_exactly(runs):
    _, results = runs
    for run in results:
        assert [s.held for s in run.stages] == predicted_held(run.schedule, CFG, B, T), \
            run.schedule.name


def test_gpipe_holds_m_micro_batches_and_1f1b_p_minus_s(runs):
    """Measured bytes / one micro-batch's: m on every stage under GPipe, p - s under 1F1B.
    layer_saved x in-flight misses only the chunk output the sender keeps (4 KiB here)."""
    p, results = runs
    for run in results:
        name = run.schedule.name
        if name not in ("gpipe", "1f1b"):
            continue
        for s, (stage, layers) in enumerate(zip(run.stages, chunk_layers(CFG.layers, p))):
            last = s == p - 1
            terms = micro_batch_terms(CFG, layers[0], B, T, last)
            flight = in_flight(s, p, M, name)
            assert stage.held == flight * sum(b for _, b, _ in terms)
            saved = sum(layer_saved(CFG, "fp32").bytes(B, T) for _ in layers[0])
            saved += head_saved(CFG, "fp32").bytes(B, T) + 8 if last else 0
            assert stage.held - flight * saved == (0 if last else flight * B * T * CFG.hidden * 4)


def test_measured_timeline_has_every_op_in_order_and_a_bubble(runs):
    """Times are not asserted (2 shared cores): only that the ops ran in the lists' order,
    without overlap on a stage, and that the stages idled somewhere."""
    p, results = runs
    for run in results:
        timeline = run.timeline
        for spans, ops in zip(timeline.stages, run.schedule.stages):
            assert tuple(span.op for span in spans) == ops
            assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))
        assert 0 < timeline.idle_fraction < 1
        ax = gantt_figure(timeline, unit="seconds").axes[0]
        assert len(ax.patches) == sum(len(ops) for ops in run.schedule.stages)


@pytest.mark.slow
def test_interleaved_on_4_stages_equals_one_process_and_the_prediction():
    cfg = dataclasses.replace(CFG, layers=8)
    run, = measure_schedules(cfg, 4, [("interleaved", 4, 2)], B, T, timeout_s=180)
    losses, grads = one_process_step(cfg, 4, B, T)
    assert run.losses == pytest.approx(losses, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(run.grads[name], grad, **TOL, msg=name)
    assert [s.held for s in run.stages] == predicted_held(run.schedule, cfg, B, T)


@pytest.mark.slow
def test_torch_pipelining_gives_the_same_losses_and_gradients_and_a_close_peak():
    cases = [("gpipe", M, 1), ("1f1b", M, 1), ("interleaved", M, 2)]
    losses, grads = one_process_step(CFG, M, B, T)
    for ours, theirs in compare_with_torch(CFG, 2, cases, B, T, timeout_s=300):
        assert theirs[-1].losses == pytest.approx(ours.losses, rel=1e-6) == losses
        for name, grad in grads.items():
            got = next(s.grads[name] for s in theirs if name in s.grads)
            torch.testing.assert_close(got, grad, **TOL, msg=name)
        for mine, torchs in zip(ours.stages, theirs):
            # torch keeps a little more (a receive buffer per micro-batch, its own copies)
            assert mine.peak <= torchs.peak <= 1.1 * mine.peak


def test_the_estimate_gives_each_stages_held_activations_and_peak_within_3_percent():
    """labkit.estimate's per-stage saved activations (in flight x layers, the outputs sent, the
    heads GPipe keeps) beside what each stage of the executor held, and each stage's peak
    (the executor runs no optimizer step: the estimate with SGD, which keeps no state) - the
    later micro-batches' backward with every gradient formed, ZB-H1's output gradients kept
    for W - for every schedule."""
    import labkit as lk
    from labkit.parallel.pipeline.pipeline_parallel import measure_schedules
    cases = [("gpipe", 4, 1), ("1f1b", 4, 1), ("zb-h1", 4, 1), ("interleaved", 4, 2)]
    runs = measure_schedules("small", 2, cases, micro_batch=1, seq=64)
    for (name, m, v), run in zip(cases, runs):
        est = lk.estimate("small", 1, 64, precision="fp32", device="cpu", optimizer="sgd",
                          layout=lk.Layout(pp=2, micro_batches=m, schedule=name, virtual_stages=v))
        for stage, predicted in zip(run.stages, est.details["stages"]):
            assert predicted["saved_activations"] == pytest.approx(stage.held, rel=0.03), name
            assert predicted["total"] == pytest.approx(stage.peak, rel=0.03), name


def test_lora_through_the_pipeline_is_the_estimate_for_every_schedule():
    """LoRA's frozen base holds no gradients and its embedding needs none; ZB-H1's W waits only
    on the adapted linears' outputs. Measured per stage: held activations within 0.7%, peaks
    within 0.9%; every schedule forms the same adapter gradients."""
    import labkit as lk
    from labkit.parallel.pipeline.pipeline_parallel import measure_schedules
    cases = [("gpipe", 4, 1), ("1f1b", 4, 1), ("zb-h1", 4, 1), ("interleaved", 4, 2)]
    runs = measure_schedules("small", 2, cases, micro_batch=1, seq=64, lora_rank=8)
    for (name, m, v), run in zip(cases, runs):
        est = lk.estimate("small", 1, 64, precision="fp32", device="cpu", optimizer="sgd",
                          trainable="lora", lora_rank=8,
                          layout=lk.Layout(pp=2, micro_batches=m, schedule=name, virtual_stages=v))
        for stage, predicted in zip(run.stages, est.details["stages"]):
            assert predicted["saved_activations"] == pytest.approx(stage.held, rel=0.03), name
            assert predicted["total"] == pytest.approx(stage.peak, rel=0.03), name
        assert len(run.grads) == 4 * 7 * 2 and all(k.endswith((".A", ".B")) for k in run.grads)
        for key, grad in runs[0].grads.items():
            torch.testing.assert_close(run.grads[key], grad, **TOL, msg=key)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_the_papers_zb_h1_bubble_is_the_equal_durations_case(p, m):
    assert pipeline_bubble(p, m, "zb-h1") == pytest.approx(zb_h1_bubble(p, m))
    assert pipeline_bubble(p, m, "zb-h1") == pytest.approx((p - 1) / (3 * m + p - 1))


@pytest.mark.slow
def test_torchs_zb_v_and_dualpipe_v_run_as_one_process_and_hold_what_the_estimate_says():
    """torch's ScheduleZBVZeroBubble and ScheduleDualPipeV on 2 gloo ranks, the chunks in a V:
    one process's losses and gradients, and each stage holding the activations its op list
    (``torch_orders.v_schedule``) says, within 5%: torch's runtime keeps or frees a
    (B, T, hidden) buffer here and there differently from labkit's count (+4.4%, +2.7% and
    -1.9% of it measured, every run alike)."""
    import labkit as lk
    from labkit.parallel import cluster
    from labkit.parallel.pipeline.torch_orders import v_schedule
    cases = [("zb-v", M, 2), ("dualpipe-v", M, 2)]
    ranks = cluster.run(torch_pipelining, 2, CFG, cases, B, T, timeout_s=300)
    losses, grads = one_process_step(CFG, M, B, T)
    for i, (name, m, _) in enumerate(cases):
        runs = [r[i] for r in ranks]
        assert runs[0].losses == pytest.approx(losses, rel=1e-6) and not runs[1].losses
        for key, grad in grads.items():
            got = next(r.grads[key] for r in runs if key in r.grads)
            torch.testing.assert_close(got, grad, **TOL, msg=key)
        predicted = predicted_held(v_schedule(name, 2, m), CFG, B, T)
        assert [r.held for r in runs] == pytest.approx(predicted, rel=0.05), name
        # the estimate (SGD: torch's runtime steps nothing) of each stage's peak: a bound more
        # than a prediction for the V. It takes ZB-H1's worst moment, a W with the stage's
        # gradients formed while other W's wait, which torch's V order does not reach: up to
        # 8% high on the stage without the loss (measured here 1.015, 1.024; `small` with 8
        # layers, 1 x 128 tokens: 1.069, 1.078), low on the loss's stage by about the logits
        # torch keeps there (0.970, 1.028 here; 0.952, 1.046 on `small`)
        est = lk.estimate(CFG, B, T, precision="fp32", device="cpu", optimizer="sgd",
                          layout=lk.Layout(pp=2, micro_batches=m, schedule=name))
        logits = B * T * CFG.vocab_size * 4
        for s, (stage, run) in enumerate(zip(est.details["stages"], runs)):
            low = 0.03 * run.peak + logits * (s == 0)
            assert run.peak - low <= stage["total"] <= 1.08 * run.peak, name
