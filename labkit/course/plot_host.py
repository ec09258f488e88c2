"""Figures of lab 08: the caching allocator's reserved bytes event by event, and a memory
snapshot read back."""
from __future__ import annotations

import numpy as np
from matplotlib.patches import Patch

from labkit.core.units import CATEGORIES, fmt_bytes
from labkit.course.plot_base import CATEGORY_COLORS, PHASE_COLORS, _downsample, new_figure, unit_for


def _shade_phases(ax, phases: list[str]) -> list:
    """Forward, backward and optimizer bands behind a per-event plot; legend handles for them
    (bands too narrow to label, such as each step's optimizer, still get a colour key)."""
    start = 0
    for i in range(1, len(phases) + 1):
        if i == len(phases) or phases[i] != phases[start]:
            if phases[start] in PHASE_COLORS:
                ax.axvspan(start, i, color=PHASE_COLORS[phases[start]], zorder=0)
            start = i
    keys = [Patch(facecolor=color, edgecolor="#aaaaaa", label=phase)
            for phase, color in PHASE_COLORS.items() if phase in phases]
    if phases and phases[0] == "setup":
        keys.insert(0, Patch(facecolor="white", edgecolor="#aaaaaa",
                             label="setup (the states alive before)"))
    return keys


def allocator_figure(replays: dict, title: str | None = None):
    """Bytes the tensors hold (allocated) and the caching allocator reserves, after each event of
    a step replayed under each setting (``{label: labkit.host.allocator.Replay}``)."""
    if not replays:
        raise ValueError("nothing to plot: pass {label: replay(events, settings)}")
    first = next(iter(replays.values()))
    name, scale = unit_for(max(r.peak_reserved for r in replays.values()))
    fig, ax = new_figure(9, 4.2)
    bands = _shade_phases(ax, first.phase)
    x = _downsample(np.array(first.allocated))
    ax.plot(x, np.array(first.allocated)[x] / scale, color="black", linewidth=1.5,
            label="allocated (the tensors' blocks)")
    for (label, r), color in zip(replays.items(), ("#0072B2", "#D55E00", "#009E73", "#CC79A7")):
        xr = _downsample(np.array(r.reserved))
        ax.plot(xr, np.array(r.reserved)[xr] / scale, color=color, linewidth=1.5,
                label=f"reserved, {label} (peak {fmt_bytes(r.peak_reserved)})")
    ax.set_xlim(0, len(first.allocated) - 1)
    ax.set_ylim(0, max(r.peak_reserved for r in replays.values()) / scale * 1.2)
    ax.set(xlabel="allocation events", ylabel=name,
           title=title or "what the caching allocator reserves, event by event")
    lines, _ = ax.get_legend_handles_labels()
    ax.legend(handles=lines + bands, frameon=False, fontsize=8, loc="lower right", ncol=2)
    return fig


def snapshot_figure(series: dict, title: str | None = None):
    """A memory snapshot's trace drawn back: live bytes per category, stacked, and the reserved
    segments above them (``labkit.host.memory_snapshot.snapshot_timeline``'s series)."""
    reserved = np.array(series["reserved"])
    if len(reserved) == 0:
        raise ValueError("the snapshot's trace is empty")
    name, scale = unit_for(reserved.max())
    cats = [c for c in CATEGORIES if c in series["by_category"]]
    x = _downsample(reserved)
    fig, ax = new_figure(9, 4.2)
    ax.stackplot(x, *[np.array(series["by_category"][c])[x] / scale for c in cats],
                 colors=[CATEGORY_COLORS[c] for c in cats], labels=[CATEGORIES[c] for c in cats])
    ax.plot(x, reserved[x] / scale, color="black", linewidth=1.2, label="reserved segments")
    ax.set_xlim(0, len(reserved) - 1)
    ax.set_ylim(0, reserved.max() / scale * 1.15)
    ax.set(xlabel="trace entries", ylabel=name, title=title or "the exported snapshot, read back")
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=4, frameon=False)
    return fig
