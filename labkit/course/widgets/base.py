"""What every panel shares: its result type, how it renders, how its controls are wired."""
from __future__ import annotations

import base64
import io
from dataclasses import dataclass

import ipywidgets as w

from labkit.core.config import ModelConfig, preset
from labkit.core.units import CATEGORIES, fmt_bytes, fmt_count
from labkit.predict import Estimate
from labkit.predict.layers import count_params
from labkit.training.measure import Measurement


SHAPE_FIELDS = ("hidden", "layers", "heads", "vocab_size")


@dataclass
class PanelResult:
    """What a panel shows: a result, or the reason there is none (never a traceback)."""

    config: ModelConfig | None = None
    estimate: Estimate | None = None
    measurement: Measurement | None = None
    error: str | None = None
    recipe: str = ""                     # "precision optimizer", named in the summary

    def summary(self) -> str:
        if self.error:
            return f"⚠ {self.error}"
        pc = count_params(self.config)
        e = self.estimate
        parts = ", ".join(f"{label} {fmt_bytes(getattr(e, key))}"
                          for key, label in CATEGORIES.items() if getattr(e, key))
        text = (f"{self.config.name}, {self.recipe}: {fmt_count(pc.total)} parameters — predicted peak per GPU "
                f"(CUDA defaults: {e.details['optimizer implementation']} AdamW) "
                f"{fmt_bytes(e.total)} (during {e.peak_phase}): {parts}")
        if self.measurement is not None:
            m = self.measurement
            text += (f"\nmeasured peak {fmt_bytes(m.total)} (during {m.peak_phase}); "
                     f"prediction off by {100 * (e.total - m.total) / m.total:+.2f}%")
        return text


def _render(output: w.Output, *items) -> None:
    """Replace what ``output`` shows with ``items`` (text lines or figures).

    The outputs are set as widget state, never captured with ``with output:``: capturing
    redirects the running cell's messages through the widget (its ``msg_id``) and sends
    ``clear_output`` to the cell, the protocol behind notebooks that stall headless
    (papermill #723, nbclient #312) with the kernel idle.
    """
    shown = []
    for item in items:
        if isinstance(item, str):
            shown.append({"output_type": "stream", "name": "stdout", "text": item + "\n"})
        else:                                 # a matplotlib figure, as the inline backend shows it
            png = io.BytesIO()
            item.savefig(png, format="png", bbox_inches="tight")
            shown.append({"output_type": "display_data", "metadata": {}, "data": {
                "image/png": base64.b64encode(png.getvalue()).decode(), "text/plain": repr(item)}})
    output.outputs = tuple(shown)


def model_config(name: str, **shape) -> ModelConfig:
    """The preset ``name`` with its shape fields (hidden, layers, heads, vocab_size) changed."""
    base = preset(name)
    changes = {k: v for k, v in shape.items() if v is not None and getattr(base, k) != v}
    return base.replace(name=name if not changes else f"{name} (modified)", **changes)


def _wire(panel, rows: list[list]) -> None:
    """A panel's controls, a row each, over its output: any change calls ``panel.update()``."""
    panel.output = w.Output()
    for control in (c for row in rows for c in row):
        control.observe(lambda _: panel.update(), names="value")
    panel.widget = w.VBox([w.HBox(row) for row in rows] + [panel.output])
    panel.update()
