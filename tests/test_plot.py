"""The figures show the numbers they are given: bar lengths, the peak, the phases, the units."""
import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from matplotlib.colors import to_hex

import labkit as lk
from labkit.course.plot import (CATEGORY_COLORS, PHASE_COLORS, _downsample, breakdown_figure,
                                param_components_figure, state_bytes_figure,
                                predicted_vs_measured_figure, timeline_figure)
from labkit.training.track import Timeline

MiB, GiB = 2**20, 2**30


@pytest.fixture(scope="module")
def measured():
    return lk.measure_step("tiny", seq=128, precision="bf16-mixed", fake=False)


@pytest.fixture(scope="module")
def predicted():
    return lk.estimate("tiny", seq=128, precision="bf16-mixed", device="cpu")


def test_breakdown_bars_are_the_categories_bytes_in_mib(measured, predicted):
    items = {"predicted": predicted, "measured": measured}
    ax = breakdown_figure(items).axes[0]
    assert "MiB" in ax.get_xlabel()                          # tiny: everything below 1 GiB
    for category, bars in zip(lk.CATEGORIES, ax.containers):
        for bar, item in zip(bars, items.values()):
            assert bar.get_width() == pytest.approx(getattr(item, category) / MiB)
            assert to_hex(bar.get_facecolor()) == CATEGORY_COLORS[category].lower()
    ends = [bars[-1].get_x() + bars[-1].get_width() for bars in ax.containers]
    assert max(ends) == pytest.approx(measured.total / MiB)   # the stack adds up to the total


def test_breakdown_writes_each_total_and_labels_each_bar(measured, predicted):
    fig = breakdown_figure({"predicted": predicted, "measured": measured}, title="tiny")
    ax = fig.axes[0]
    texts = [t.get_text().strip() for t in ax.texts]
    assert lk.fmt_bytes(predicted.total) in texts and lk.fmt_bytes(measured.total) in texts
    assert [t.get_text() for t in ax.get_yticklabels()] == ["predicted", "measured"]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == list(lk.CATEGORIES.values())
    assert ax.get_title() == "tiny"


def test_breakdown_switches_to_gib_for_a_7b_model():
    est = lk.estimate("llama-2-7b", seq=2048)
    ax = breakdown_figure({"predicted": est}).axes[0]
    assert "GiB" in ax.get_xlabel()
    total = sum(bars[0].get_width() for bars in ax.containers)
    assert total == pytest.approx(est.total / GiB)


def test_timeline_marks_the_peak_at_the_largest_total(measured):
    ax = timeline_figure(measured).axes[0]
    total = np.array(measured.timeline.total)
    (dot,) = [line for line in ax.lines if line.get_marker() == "o"]
    assert dot.get_xdata()[0] == total.argmax()
    assert dot.get_ydata()[0] == pytest.approx(total.max() / MiB)
    assert any(lk.fmt_bytes(total.max()) in t.get_text() for t in ax.texts)
    assert ax.get_xlabel() == "allocation events" and "MiB" in ax.get_ylabel()


def test_timeline_shades_and_labels_each_phase(measured):
    ax = timeline_figure(measured.timeline).axes[0]            # a bare Timeline works too
    labels = {t.get_text() for t in ax.texts}
    assert {"forward", "backward", "optimizer"} <= labels
    band_colors = {to_hex(p.get_facecolor()) for p in ax.patches}
    assert {c.lower() for c in PHASE_COLORS.values()} <= band_colors
    spans = {phase: (start, end) for phase, start, end in measured.timeline.phase_spans()}
    backward = PHASE_COLORS["backward"].lower()
    (band,) = [p for p in ax.patches if to_hex(p.get_facecolor()) == backward]
    assert band.get_x() == spans["backward"][0]


def test_downsampling_keeps_the_peak_of_a_long_timeline():
    rng = np.random.default_rng(0)
    n = 50_000
    timeline = Timeline(phase=["forward"] * n,
                        by_category={c: list(rng.integers(0, 100, n)) for c in lk.CATEGORIES})
    total = np.array(timeline.total)
    kept = _downsample(total)
    assert len(kept) <= 2000 and total.argmax() in kept
    ax = timeline_figure(timeline).axes[0]
    (dot,) = [line for line in ax.lines if line.get_marker() == "o"]
    assert dot.get_xdata()[0] == total.argmax()


def test_predicted_vs_measured_plots_each_row_and_the_diagonal():
    rows = [("a", 100 * MiB, 101 * MiB), ("b", 300 * MiB, 300 * MiB)]
    scatter_ax, error_ax = predicted_vs_measured_figure(rows).axes
    points = scatter_ax.collections[0].get_offsets()
    assert np.allclose(points, [[101, 100], [300, 300]])       # (measured, predicted) in MiB
    (diagonal,) = [line for line in scatter_ax.lines if line.get_linestyle() == "--"]
    assert np.allclose(diagonal.get_xdata(), diagonal.get_ydata())
    widths = [bar.get_width() for bar in error_ax.containers[0]]
    assert widths == pytest.approx([100 * (100 - 101) / 101, 0])
    assert [t.get_text() for t in error_ax.get_yticklabels()] == ["1. a", "2. b"]


def test_figures_are_not_left_open_in_pyplot(measured):
    before = plt.get_fignums()
    breakdown_figure({"m": measured})
    timeline_figure(measured)
    predicted_vs_measured_figure([("m", measured.total, measured.total)])
    assert plt.get_fignums() == before


def test_empty_inputs_say_what_to_pass():
    with pytest.raises(ValueError, match="Breakdown"):
        breakdown_figure({})
    with pytest.raises(ValueError, match="predicted bytes"):
        predicted_vs_measured_figure([])


def test_state_bytes_bars_add_up_to_the_bytes_per_parameter():
    fig = state_bytes_figure({"fp32 AdamW": (4, 4, 8), "mixed AdamW": (2, 2, 12)})
    ax = fig.axes[0]
    ends = {}
    for bar in ax.patches:
        y = round(bar.get_y() + bar.get_height() / 2)
        ends[y] = max(ends.get(y, 0), bar.get_x() + bar.get_width())
    assert sorted(ends.values()) == [16, 16]
    assert "bytes per parameter" in ax.get_xlabel()


def test_parameter_components_are_shares_of_the_total():
    counts = {n: lk.count_params(n) for n in ("llama-2-7b", "deepseek-v3")}
    ax = param_components_figure(counts).axes[0]
    ends = {}
    for bar in ax.patches:
        y = round(bar.get_y() + bar.get_height() / 2)
        ends[y] = max(ends.get(y, 0), bar.get_x() + bar.get_width())
    assert all(abs(v - 100) < 1e-9 for v in ends.values())
    texts = [t.get_text() for t in ax.texts]
    assert any("671B total" in t for t in texts) and any("37.6B active" in t for t in texts)


def test_exponent_figure_shades_the_format_ranges_and_shifts_by_the_loss_scale():
    from labkit.course.plot import exponent_figure
    values = torch.full((100,), 2.0 ** -20)
    ax = exponent_figure(values, torch.float16, loss_scale=2.0 ** 16).axes[0]
    centres = sorted({round(b.get_x() + b.get_width() / 2) for b in ax.patches if b.get_height() == 100})
    assert centres == [-20, -4]
    labels = [t.get_text() for t in ax.get_figure().legends[0].get_texts()]
    assert any("normal range" in t for t in labels) and any("subnormal" in t for t in labels)


def test_bits_error_figure_draws_one_labelled_point_per_row_on_a_log_scale():
    from labkit.quantisation.gptq import CompareRow
    from labkit.course.plot import bits_error_figure
    rows = [("rtn int2 g64", 2.28125, 0.45), ("rtn int4 g64", 4.3125, 0.09),
            ("gptq int2 g64", 2.28125, 0.56), ("gptq int4 g64", 4.3125, 0.11),
            CompareRow("nf4", 4.127, 0.092, 0.05, 1.8, 0.1)]            # an object: weight_error
    ax = bits_error_figure(rows, highlight=4).axes[0]
    points = np.concatenate([c.get_offsets() for c in ax.collections[:-1]])   # last: the ring
    assert sorted(map(tuple, points.tolist())) == sorted(
        [(2.28125, 0.45), (4.3125, 0.09), (2.28125, 0.56), (4.3125, 0.11), (4.127, 0.092)])
    assert ax.collections[-1].get_offsets().tolist() == [[4.127, 0.092]]   # the highlight
    assert sorted(t.get_text() for t in ax.texts) == sorted(
        ["rtn int2 g64", "rtn int4 g64", "gptq int2 g64", "gptq int4 g64", "nf4"])
    assert ax.get_yscale() == "log" and "bits per parameter" in ax.get_xlabel()
    lines = sorted(line.get_xydata().tolist() for line in ax.lines)   # rtn and gptq joined
    assert lines == [[[2.28125, 0.45], [4.3125, 0.09]], [[2.28125, 0.56], [4.3125, 0.11]]]


def test_bits_error_figure_keeps_close_labels_apart_and_refuses_what_it_cannot_show():
    from labkit.course.plot import bits_error_figure
    rows = [("nf4 b64", 4.5, 0.0416), ("nf4 b64 dq", 4.127, 0.0416), ("rtn int4 g64", 4.3125,
                                                                       0.0408)]
    fig = bits_error_figure(rows)
    fig.canvas.draw()
    boxes = [t.get_window_extent() for t in fig.axes[0].texts]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    with pytest.raises(ValueError, match="log scale cannot show"):
        bits_error_figure([("fp32", 32.0, 0.0)])
    with pytest.raises(ValueError, match="no rows to plot"):
        bits_error_figure([])


def test_allocator_and_snapshot_figures_draw_a_replayed_step():
    from labkit.host.allocator import AllocatorSettings, replay
    from labkit.host.memory_snapshot import snapshot, snapshot_timeline
    m = lk.measure_step("tiny", batch=2, seq=32, fake=True, events=True)
    runs = {"native": replay(m.events),
            "expandable": replay(m.events, AllocatorSettings(expandable_segments=True))}
    from labkit.course import plot
    fig = plot.allocator_figure(runs)
    assert len(fig.axes[0].lines) == 3                       # allocated, two reserved
    fig = plot.snapshot_figure(snapshot_timeline(snapshot(runs["native"])))
    assert fig.axes[0].get_ylim()[1] > 0
    with pytest.raises(ValueError, match="nothing to plot"):
        plot.allocator_figure({})
