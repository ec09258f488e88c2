"""Matplotlib figures every lab shows: the peak's breakdown, the memory timeline of one step,
and predicted vs measured (shared pieces in ``plot_base``, lab 08's in ``plot_host``). Each
returns a ``Figure`` that pyplot does not keep open: display it or save it; nothing
accumulates when a notebook or a test draws hundreds."""
from __future__ import annotations

import re

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch
from matplotlib.transforms import blended_transform_factory

from labkit.core.units import CATEGORIES, OP_COLORS, Breakdown, fmt_bytes, fmt_count
from labkit.course.panel_reports import BARS_TITLE, STAGE_KEY, gantt_title, op_names
from labkit.course.plot_base import (CATEGORY_COLORS, MAX_POINTS, PHASE_COLORS,  # noqa: F401
                                     _downsample, _legend, new_figure, unit_for)
from labkit.course.plot_host import allocator_figure, snapshot_figure  # noqa: F401
from labkit.predict.papers import model_state_bytes
from labkit.training.track import Timeline


def breakdown_figure(items: dict[str, Breakdown], title: str | None = None):
    """One horizontal bar per item (e.g. predicted, measured), stacked by category."""
    if not items:
        raise ValueError("nothing to plot: pass {label: Breakdown}, e.g. {'measured': m}")
    labels = list(items)
    name, scale = unit_for(max(b.total for b in items.values()))
    fig, ax = new_figure(8, 1.6 + 0.55 * len(labels))
    left = np.zeros(len(labels))
    for category in CATEGORIES:
        values = np.array([getattr(items[k], category) for k in labels]) / scale
        ax.barh(labels, values, left=left, color=CATEGORY_COLORS[category], label=CATEGORIES[category],
                height=0.6)
        left += values
    for y, label in enumerate(labels):
        ax.text(left[y], y, "  " + fmt_bytes(items[label].total), va="center")
    ax.set_xlim(0, left.max() * 1.22)            # room for the totals
    ax.invert_yaxis()                            # first item on top
    ax.set_xlabel(f"memory at the peak ({name})")
    ax.set_title(title or BARS_TITLE)
    _legend(fig, ax)
    return fig


def timeline_figure(m, title: str | None = None):
    """Live bytes per category over one step's allocation events, phases shaded, peak marked."""
    timeline: Timeline = getattr(m, "timeline", m)
    total = np.array(timeline.total)
    if len(total) == 0:
        raise ValueError("the timeline is empty: measure with MemoryTracker(timeline=True)")
    name, scale = unit_for(total.max())
    x = _downsample(total)
    fig, ax = new_figure(9, 4.8)
    ax.stackplot(x, *[np.array(timeline.by_category[c])[x] / scale for c in CATEGORIES],
                 colors=[CATEGORY_COLORS[c] for c in CATEGORIES], labels=list(CATEGORIES.values()))
    top = blended_transform_factory(ax.transData, ax.transAxes)
    for phase, start, end in timeline.phase_spans():
        if phase in PHASE_COLORS:
            ax.axvspan(start, end, color=PHASE_COLORS[phase], zorder=0)
            if end - start > 0.06 * len(total):          # label only bands wide enough
                ax.text((start + end) / 2, 0.97, phase, transform=top, ha="center", va="top")
    peak = int(total.argmax())
    ax.plot(peak, total[peak] / scale, "o", color="black", zorder=3)
    ax.axhline(total[peak] / scale, color="black", linestyle=":", linewidth=1)
    ax.annotate(f"peak {fmt_bytes(total[peak])}", (peak, total[peak] / scale),
                xytext=(0, 8), textcoords="offset points",
                ha="right" if peak > 0.7 * len(total) else "left",
                bbox=dict(boxstyle="round", fc="white", ec="none", alpha=0.8))
    ax.set_xlim(0, len(total) - 1)
    ax.set_ylim(0, total.max() / scale * 1.25)       # headroom for the labels
    ax.set_xlabel("allocation events")
    ax.set_ylabel(f"live memory ({name})")
    ax.set_title(title or "memory over one training step")
    _legend(fig, ax)
    return fig


def predicted_vs_measured_figure(rows: list[tuple[str, int, int]], title: str | None = None):
    """Predicted against measured totals (left, on y = x when they agree) and each error (right).

    ``rows``: (label, predicted bytes, measured bytes), e.g. one per model or setting.
    """
    if not rows:
        raise ValueError("no rows to plot: pass [(label, predicted bytes, measured bytes), ...]")
    labels = [f"{i}. {label}" for i, (label, _, _) in enumerate(rows, 1)]
    predicted, measured = np.array([r[1:] for r in rows], dtype=float).T
    name, scale = unit_for(max(predicted.max(), measured.max()))
    fig, (ax, err) = new_figure(11, 1.8 + 0.4 * max(len(rows), 6), ncols=2)

    ax.scatter(measured / scale, predicted / scale, color=CATEGORY_COLORS["params"], zorder=3)
    # points are numbered as the rows on the right; offsets alternate so equal points stay legible
    offsets = [((7, -4), "left"), ((-7, -4), "right"), ((0, 6), "center"), ((0, -15), "center")]
    for i, (x, y) in enumerate(zip(measured / scale, predicted / scale)):
        xytext, ha = offsets[i % len(offsets)]
        ax.annotate(str(i + 1), (x, y), xytext=xytext, textcoords="offset points", ha=ha)
    low, high = min(predicted.min(), measured.min()) / scale, max(predicted.max(),
                                                                    measured.max()) / scale
    if high > 30 * low > 0:                                # sizes over decades: log axes
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.plot([low, high], [low, high], "--", color="grey", label="predicted = measured")
    ax.margins(0.12)
    ax.set_xlabel(f"measured ({name})")
    ax.set_ylabel(f"predicted ({name})")
    ax.legend(loc="upper left", frameon=False)

    error = 100 * (predicted - measured) / measured
    err.barh(labels, error, color="#555555", height=0.6)
    err.axvline(0, color="black", linewidth=1)
    for y, e in enumerate(error):
        err.text(e, y, f" {e:+.3f}% ", va="center", ha="left" if e >= 0 else "right")
    reach = max(abs(error).max(), 0.5) * 1.6
    err.set_xlim(-reach, reach)
    err.invert_yaxis()
    err.set_xlabel("(predicted - measured) / measured (%)")
    fig.suptitle(title or "predicted vs measured peak")
    return fig


def state_bytes_figure(rows: dict[str, tuple[float, float, float]], title: str | None = None):
    """Bytes per parameter of (weights, gradients, optimizer state), one stacked bar per recipe."""
    if not rows:
        raise ValueError("nothing to plot: pass {label: (weight, gradient, optimizer) bytes}")
    labels = list(rows)
    fig, ax = new_figure(8, 1.4 + 0.45 * len(labels))
    left = np.zeros(len(labels))
    for i, category in enumerate(("params", "grads", "optimizer")):
        values = np.array([rows[k][i] for k in labels], dtype=float)
        ax.barh(labels, values, left=left, color=CATEGORY_COLORS[category],
                label=CATEGORIES[category], height=0.6)
        left += values
    for y, total in enumerate(left):
        ax.text(total, y, f"  {total:g}", va="center")
    ax.set_xlim(0, left.max() * 1.12)
    ax.invert_yaxis()
    ax.set_xlabel("bytes per parameter (model states only)")
    ax.set_title(title or "model states per parameter")
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=3, frameon=False)
    return fig


def param_components_figure(counts: dict, title: str | None = None):
    """Each model's parameters split by component (share of the total), total and active written."""
    if not counts:
        raise ValueError("nothing to plot: pass {model name: lk.count_params(...)}")
    names = list(counts)
    components = list(dict.fromkeys(k for pc in counts.values() for k in pc.by_component))
    colors = dict(zip(components, plt.get_cmap("tab10").colors))
    fig, ax = new_figure(9, 1.6 + 0.55 * len(names))
    left = np.zeros(len(names))
    for component in components:
        share = np.array([counts[n].by_component.get(component, 0) / counts[n].total
                          for n in names]) * 100
        ax.barh(names, share, left=left, color=colors[component], label=component, height=0.6)
        left += share
    for y, n in enumerate(names):
        pc = counts[n]
        ax.text(101, y, f"{fmt_count(pc.total)} total, {fmt_count(pc.active)} active",
                va="center")
    ax.set_xlim(0, 150)
    ax.set_xticks(range(0, 101, 20))
    ax.invert_yaxis()
    ax.set_xlabel("share of the model's parameters (%)")
    ax.set_title(title or "where the parameters are")
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center",
               ncol=min(4, len(components)), frameon=False)
    return fig


def exponent_figure(values, dtype, loss_scale: float | None = None, title: str | None = None):
    """Histogram of the values' base-2 exponents against a format's normal and subnormal ranges;
    with ``loss_scale``, the same values multiplied by it (what loss scaling does)."""
    from labkit.quantisation.precision import exponent_histogram, format_info
    info = format_info(dtype)
    fig, ax = new_figure(9, 3.8)
    ax.axvspan(np.log2(info.min_subnormal), np.log2(info.min_normal), color="#FBEFE3",
               label=f"{info.name} subnormal (few bits left)")
    ax.axvspan(np.log2(info.min_normal), np.log2(info.max), color="#E6F5EF",
               label=f"{info.name} normal range")
    series = [("gradients", values, CATEGORY_COLORS["grads"])]
    if loss_scale:
        series.append((f"x {loss_scale:g} (loss scaling)", values * loss_scale,
                       CATEGORY_COLORS["params"]))
    for label, tensor, color in series:
        hist = exponent_histogram(tensor)
        ax.bar(list(hist), list(hist.values()), width=0.9, color=color, alpha=0.8, label=label)
    ax.axvline(np.log2(info.min_subnormal), color="black", linewidth=1)
    ax.text(np.log2(info.min_subnormal), ax.get_ylim()[1] * 0.95, "smaller: becomes 0 ",
            va="top", ha="right", fontsize=9)
    ax.set_xlabel("exponent: floor(log2 |value|)")
    ax.set_ylabel("how many values")
    ax.set_title(title or f"where the values fall in {info.name}")
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=2, frameon=False)
    return fig


def savings_figure(panels: dict, percents=(40, 50), title: str | None = None,
                   against: str = "fp32"):
    """Peak saved against ``against`` (%) vs tokens per step, one panel per layout
    ({title: [sweep.Saving]}), one line per change.

    Hollow markers: the optimizer step sets the changed step's peak; filled: the activations do
    (at the loss or in the backward pass). A dotted line marks where each change's peak first
    leaves the optimizer step: the crossover.
    """
    if not panels or not all(panels.values()):
        raise ValueError("nothing to plot: pass {panel title: labkit.predict.sweep.sweep(...)}")
    fig, axes = new_figure(5.2 * len(panels), 3.9, ncols=len(panels), sharey=True, squeeze=False)
    colors = [CATEGORY_COLORS[c] for c in ("params", "optimizer", "activations", "weight_cache")]
    for ax, (name, rows) in zip(axes[0], panels.items()):
        for color, label in zip(colors, dict.fromkeys(r.label for r in rows)):
            pts = sorted((r for r in rows if r.label == label), key=lambda r: r.tokens)
            x, y = [r.tokens for r in pts], [100 * r.saved for r in pts]
            ax.plot(x, y, "-", color=color, label=label, linewidth=1)
            back = [not r.moment.startswith("optimizer step") for r in pts]   # its phases too
            ax.scatter(x, y, s=22, color=color, zorder=3,
                       facecolors=[color if b else "white" for b in back])
            if any(back) and not all(back):
                ax.axvline(x[back.index(True)], color=color, linestyle=":", linewidth=1.2)
        for p in percents:
            ax.axhline(p, color="black", linewidth=0.6, linestyle="--")
            ax.text(min(r.tokens for r in rows), p, f" {p}%",
                    va="bottom", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="tokens per step (batch x seq)", title=name)
    axes[0][0].set_ylabel(f"peak saved against {against} (%)")
    axes[0][0].legend(frameon=False, fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title)
    return fig


def utilisation_figure(sweep: dict[str, dict[float, list]], title: str | None = None):
    """Memory utilisation of each batcher against the spread of document lengths, one panel per
    corpus ({panel title: {sigma: compare_batching(...)}}); utilisation is real tokens per
    step over the largest batch's positions (``Batching.utilisation``)."""
    if not sweep or not all(sweep.values()):
        raise ValueError("nothing to plot: pass {title: {sigma: batching.compare_batching(...)}}")
    fig, axes = new_figure(5.2 * len(sweep), 3.6, ncols=len(sweep), sharey=True, squeeze=False)
    for ax, (name, runs) in zip(axes[0], sweep.items()):
        sigmas = sorted(runs)
        for i, label in enumerate(b.name for b in runs[sigmas[0]]):
            ax.plot(sigmas, [100 * next(b for b in runs[s] if b.name == label).utilisation
                             for s in sigmas], "o-", label=label, color=f"C{i}")
        ax.set(xlabel="spread of log-length (sigma)", title=name, ylim=(0, 105))
    axes[0][0].set_ylabel("real tokens per step / largest batch (%)")
    axes[0][0].legend(frameon=False, fontsize=8)
    if title:
        fig.suptitle(title)
    return fig


def gantt_figure(timeline, title: str | None = None, unit: str = "time"):
    """One row per pipeline stage, each op a bar coloured by kind (F forward, B backward, W
    weight gradient) and labelled with its micro-batch (.chunk when interleaved); idle time
    stays white. ``timeline``: ``schedules.simulate(...)`` or a measured run's ``.timeline``
    (``unit``: what its times count, e.g. "seconds")."""
    spans = [span for stage in timeline.stages for span in stage]
    if not spans:
        raise ValueError("the timeline has no ops: pass "
                         "labkit.parallel.pipeline.schedules.simulate(...) or "
                         "labkit.parallel.pipeline.pipeline_parallel.measure_schedules(...)[i]"
                         ".timeline")
    t0 = min(float(span.start) for span in spans)
    makespan = max(float(span.end) for span in spans) - t0
    split = any(span.op.kind == "W" for span in spans)
    width_in = min(14.0, 4 + 0.2 * len(spans) / timeline.p)
    fig, ax = new_figure(width_in, 1.3 + 0.45 * timeline.p)
    for s, stage in enumerate(timeline.stages):
        for op, start, end in stage:
            left, width = float(start) - t0, float(end) - float(start)
            ax.barh(s, width, left=left, height=0.8, color=OP_COLORS[op.kind],
                    edgecolor="white", linewidth=0.6)
            label = f"{op.micro_batch}" + (f".{op.chunk}" if timeline.v > 1 else "")
            if width / makespan * 0.85 * width_in > 0.055 * (len(label) + 1):  # room to read
                ax.text(left + width / 2, s, label, ha="center", va="center", fontsize=7,
                        color="white")
    names = op_names(split)
    ax.set_yticks(range(timeline.p), [f"stage {s}" for s in range(timeline.p)])
    ax.set_ylim(timeline.p - 0.5, -0.5)                  # stage 0 on top
    ax.set_xlim(0, makespan)
    ax.set_xlabel(unit)
    ax.set_title(title or gantt_title(timeline))
    handles = [Patch(color=OP_COLORS[k], label=name) for k, name in names.items()]
    fig.legend(handles=handles, loc="outside lower center", ncol=3, frameon=False)
    return fig


def stage_peaks_figure(stages: dict[str, dict], title: str | None = None):
    """One bar per pipeline stage: its peak per GPU, and inside it the activations it keeps for
    the backward pass at the end of its forward passes (``estimate(...).details["stages"]``)."""
    if not stages:
        raise ValueError("nothing to plot: pass {label: lk.estimate(...).details['stages'][s]}")
    labels = list(stages)
    name, scale = unit_for(max(s["total"] for s in stages.values()))
    fig, ax = new_figure(8, 1.6 + 0.55 * len(labels))
    peaks = np.array([stages[k]["total"] for k in labels]) / scale
    kept = np.array([stages[k]["saved_activations"] for k in labels]) / scale
    (peak_label, peak_colour), (kept_label, kept_colour) = STAGE_KEY["peak"], STAGE_KEY["kept"]
    ax.barh(labels, peaks, height=0.6, color=peak_colour, label=peak_label)
    ax.barh(labels, kept, height=0.3, color=kept_colour, label=kept_label)
    for y, label in enumerate(labels):
        ax.text(peaks[y], y, "  " + fmt_bytes(stages[label]["total"]), va="center")
    ax.set_xlim(0, peaks.max() * 1.22)           # room for the totals
    ax.invert_yaxis()                            # stage 0 on top
    ax.set_xlabel(f"memory per GPU ({name})")
    ax.set_title(title or "each pipeline stage's peak")
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=2, frameon=False)
    return fig


def scaling_figure(rows_by_model: dict, title: str | None = None):
    """Bytes per rank against N, log-log, for each model's ``fake_fsdp2_scaling`` rows:
    measured (markers), estimated (line), the model states 16 Psi / N (dashed: ZeRO's Table 1,
    stage 3) and the activations, which no N divides (dotted): at large N they dominate."""
    everything = [r[k] for rows in rows_by_model.values() for r in rows
                  for k in ("peak", "estimate") if k in r]
    unit, scale = unit_for(max(everything, default=0))
    fig, ax = new_figure(9, 4.8)
    for i, (name, rows) in enumerate(rows_by_model.items()):
        color, n_all = f"C{i}", [r["world_size"] for r in rows]
        done = [r for r in rows if "peak" in r]
        ax.plot([r["world_size"] for r in done], [r["peak"] / scale for r in done], "o",
                color=color, label=f"{name}: measured (FSDP2, fake tensors)")
        ax.plot(n_all, [r["estimate"] / scale for r in rows], "-", color=color,
                label=f"{name}: estimate")
        states = [model_state_bytes(r["n_params"], r["precision"], zero_stage=3,
                                    dp=r["world_size"]) for r in rows]
        ax.plot(n_all, [b / scale for b in states], "--", color=color, alpha=0.7,
                label=f"{name}: model states 16Ψ/N")
        ax.plot(n_all, [r["estimate_by_category"]["activations"] / scale for r in rows], ":",
                color=color, alpha=0.7, label=f"{name}: activations")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("data-parallel ranks N")
    ax.set_ylabel(f"{unit} per rank")
    ax.set_title(title or "ZeRO-3 (FSDP2): bytes per rank against N")
    ax.grid(True, which="both", alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside right center", fontsize="small",
               frameon=False)
    return fig


# ---- lab 06: bits per parameter against quantisation error ---------------------------------------
FAMILY_COLORS = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#999999"]


def _bits_error_row(row) -> tuple[str, float, float]:
    """(label, bits per parameter, error) of a tuple, or of an object with ``bits_per_param``
    and ``error`` or ``weight_error`` (``gptq.CompareRow``) and ``label`` or ``method``."""
    if isinstance(row, tuple):
        return row
    label = getattr(row, "label", None) or getattr(row, "method")
    error = getattr(row, "error", None)
    return label, row.bits_per_param, row.weight_error if error is None else error


def bits_error_figure(rows, title: str | None = None, highlight: int | None = None,
                      ylabel: str = "relative error ||W - W~|| / ||W||"):
    """Error (log scale) against stored bits per parameter, one labelled point per row; rows of
    one family (labels equal but for the bit width: "rtn int2 g64", "rtn int4 g64") are joined
    in order of bits. ``highlight``: the index of a row drawn larger (the panel's setting)."""
    rows = [_bits_error_row(row) for row in rows]
    if not rows:
        raise ValueError("no rows to plot: pass [(label, bits per parameter, error), ...] or "
                         "gptq.compare()'s rows")
    for label, _, error in rows:
        if not error > 0:
            raise ValueError(f"{label!r} has error {error}, which a log scale cannot show: leave "
                             "it out (fp32 is exact)")
    families: dict[str, list[int]] = {}
    for i, (label, _, _) in enumerate(rows):
        families.setdefault(re.sub(r"int\d+", "int", label), []).append(i)
    fig, ax = new_figure(8, 4.8)
    for k, members in enumerate(families.values()):
        color = FAMILY_COLORS[k % len(FAMILY_COLORS)]
        members = sorted(members, key=lambda i: rows[i][1])
        bits, errors = [rows[i][1] for i in members], [rows[i][2] for i in members]
        if len(members) > 1:
            ax.plot(bits, errors, color=color, linewidth=1, alpha=0.6, zorder=1)
        ax.scatter(bits, errors, color=color, zorder=2)
    if highlight is not None:
        _, bits, error = rows[highlight]
        ax.scatter([bits], [error], s=220, facecolor="none", edgecolor="black", linewidth=2,
                   zorder=3, label="this setting")
        ax.legend(loc="upper right", frameon=False)
    ax.set_yscale("log")
    ax.set_xlim(min(r[1] for r in rows) - 0.5, max(r[1] for r in rows) + 1.5)   # room to label
    errors = [r[2] for r in rows]
    ax.set_ylim(min(errors) / 2, max(errors) * 2)
    _place_labels(ax, rows, highlight)
    ax.set_xlabel("stored bits per parameter (scales and zero points included)")
    ax.set_ylabel(ylabel)
    ax.set_title(title or "fewer bits, more error")
    return fig


LABEL_OFFSETS = [(6, 3, "left"), (6, -11, "left"), (-6, 3, "right"), (-6, -11, "right"),
                 (6, 13, "left"), (6, -21, "left"), (-6, 13, "right"), (-6, -21, "right")]


def _place_labels(ax, rows, highlight, fontsize: float = 8):
    """Label each point beside it, on the first side (of LABEL_OFFSETS) where the text covers no
    point and no label placed before it: close points (nf4 and rtn int4) stay legible."""
    to_points = 72 / ax.figure.dpi
    centres = [ax.transData.transform((bits, error)) * to_points for _, bits, error in rows]
    placed = [(x - 3, y - 3, x + 3, y + 3) for x, y in centres]    # (x0, y0, x1, y1) in points
    for i, ((label, bits, error), (x, y)) in enumerate(zip(rows, centres)):
        width, height = 0.58 * fontsize * len(label), fontsize
        for dx, dy, ha in LABEL_OFFSETS:
            x0 = x + dx - (width if ha == "right" else 0)
            box = (x0, y + dy, x0 + width, y + dy + height)
            if not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3]
                       for b in placed):
                break
        else:                                                   # crowded: the first side
            dx, dy, ha = LABEL_OFFSETS[0]
            x0 = x + dx
            box = (x0, y + dy, x0 + width, y + dy + height)
        placed.append(box)
        ax.annotate(label, (bits, error), xytext=(dx, dy), textcoords="offset points", ha=ha,
                    fontsize=fontsize, fontweight="bold" if i == highlight else "normal")


def course_savings_figure(rows, title: str | None = None):
    """One bar per technique: the share of the per-GPU peak it removed, in its own regime
    (``labkit.course.savings.course_savings``), labelled with its lab and bytes before -> after."""
    if not rows:
        raise ValueError("nothing to plot: pass labkit.course.savings.course_savings()")
    fig, ax = new_figure(9, 0.9 + 0.5 * len(rows))
    y = np.arange(len(rows))[::-1]
    ax.barh(y, [100 * r.saved for r in rows], color="#0072B2")
    for yi, r in zip(y, rows):
        ax.text(100 * max(r.saved, 0) + 1, yi, f"{fmt_bytes(r.before)} -> {fmt_bytes(r.after)}",
                va="center", fontsize=8)
    ax.set_yticks(y, [f"lab {r.lab}: {r.technique}\n{r.regime}" for r in rows], fontsize=8)
    ax.set_xlim(0, 125)
    ax.set_xticks(range(0, 101, 20))
    ax.set(xlabel="share of the per-GPU peak removed (%)",
           title=title or "what each technique saved, in a regime where it matters")
    return fig
