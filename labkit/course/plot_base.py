"""What every labkit figure shares: one colour per memory category and phase, the unit of an
axis, a figure pyplot does not keep, and a series thinned without losing its peaks."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from labkit.core.units import CATEGORIES, CATEGORY_COLORS  # noqa: F401 (the figures' colours)

PHASE_COLORS = {"forward": "#E8F1FA", "backward": "#FBEFE3", "optimizer": "#E6F5EF"}
MAX_POINTS = 2000


def unit_for(largest: float) -> tuple[str, int]:
    """GiB, or MiB when everything is below 1 GiB (binary units, as ``fmt_bytes``)."""
    return ("GiB", 2**30) if largest >= 2**30 else ("MiB", 2**20)


def _legend(fig, ax):
    """The categories' legend below the axes, where it never covers data."""
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center",
               ncol=len(CATEGORIES), frameon=False)


def new_figure(width: float, height: float, **kwargs):
    """A constrained-layout figure that pyplot forgets at once (returned, never shown twice)."""
    fig, ax = plt.subplots(figsize=(width, height), layout="constrained", **kwargs)
    plt.close(fig)                   # not kept by pyplot: no double display, no leak in loops
    return fig, ax


def _downsample(total: np.ndarray, limit: int = MAX_POINTS) -> np.ndarray:
    """Indices of at most ``limit`` events: each bucket's lowest and highest, so no peak is lost."""
    if len(total) <= limit:
        return np.arange(len(total))
    keep = set()
    for bucket in np.array_split(np.arange(len(total)), limit // 2):
        keep.update((bucket[total[bucket].argmin()], bucket[total[bucket].argmax()]))
    return np.array(sorted(keep))
