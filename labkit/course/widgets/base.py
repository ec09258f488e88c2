"""What every panel shares: how it renders, how its controls are wired, and how the website reads
them (its result types are ``labkit.course.panel_reports``)."""
from __future__ import annotations

import base64
import io

import ipywidgets as w


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


def controls_spec(panel) -> dict:
    """A panel's controls as the website's live panel draws them, in the order the panel shows
    them: [{name, kind, label, value, options | min, max, step (continuous)}], its fixed arguments
    (plain attributes, such as the sequence the states panel steps); buttons and outputs left
    out. ``name`` is the panel's attribute (a memory panel's shape box: its field)."""
    names = {id(control): name for attribute, value in vars(panel).items()
             if not attribute.startswith("_")
             for name, control in (value.items() if isinstance(value, dict) else [(attribute, value)])
             if isinstance(control, (w.Dropdown, w.Checkbox, w.IntSlider, w.BoundedIntText))}
    controls = []

    def visit(widget):
        for child in getattr(widget, "children", ()):
            visit(child)
        if id(widget) not in names:
            return
        spec = {"name": names[id(widget)], "label": widget.description, "value": widget.value}
        if isinstance(widget, w.Dropdown):
            spec |= {"kind": "select", "options": list(widget.options)}
        elif isinstance(widget, w.Checkbox):
            spec |= {"kind": "checkbox"}
        elif isinstance(widget, w.IntSlider):  # it answers as it moves, or once let go
            spec |= {"kind": "range", "min": widget.min, "max": widget.max, "step": widget.step,
                     "continuous": widget.continuous_update}
        else:                                  # BoundedIntText: a whole number within bounds
            spec |= {"kind": "number", "min": widget.min, "max": widget.max, "step": 1}
        controls.append(spec)

    visit(panel.widget)
    fixed = {name: value for name, value in vars(panel).items()
             if not name.startswith("_") and isinstance(value, (str, int, float, bool))}
    return {"controls": controls, "fixed": fixed}
