"""What every panel shares: how it renders and how its controls are wired (its result type is
``labkit.course.panel_reports``)."""
from __future__ import annotations

import base64
import io

import ipywidgets as w

from labkit.course.panel_reports import PanelResult, SHAPE_FIELDS, model_config  # noqa: F401


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


def _wire(panel, rows: list[list]) -> None:
    """A panel's controls, a row each, over its output: any change calls ``panel.update()``."""
    panel.output = w.Output()
    for control in (c for row in rows for c in row):
        control.observe(lambda _: panel.update(), names="value")
    panel.widget = w.VBox([w.HBox(row) for row in rows] + [panel.output])
    panel.update()
