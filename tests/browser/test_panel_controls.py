"""The registry the browser test reads (``labkit.course.widgets.PANEL_CONTROLS``) names real
controls: each panel has one dropdown and one slider with those descriptions, the option is
the dropdown's, and moving either changes what the panel shows. Runs without a browser."""
import ipywidgets as w
import pytest

from labkit.course import widgets
from labkit.course.widgets import PANEL_CONTROLS


def parts(widget):
    """``widget`` and every widget inside it."""
    yield widget
    for child in getattr(widget, "children", ()):
        yield from parts(child)


def shown(panel) -> list:
    return [(c.value if isinstance(c, w.HTML) else c.outputs) for c in parts(panel)
            if isinstance(c, (w.HTML, w.Output))]


@pytest.mark.parametrize("name", PANEL_CONTROLS)
def test_each_registered_control_exists_and_changes_its_panel(name):
    labels, panel = PANEL_CONTROLS[name], getattr(widgets, name)()
    found = {kind: [c for c in parts(panel) if isinstance(c, cls) and c.description == labels[kind]]
             for kind, cls in (("dropdown", w.Dropdown), ("slider", w.IntSlider))}
    assert {k: len(v) for k, v in found.items()} == {"dropdown": 1, "slider": 1}, found
    (dropdown,), (slider,) = found["dropdown"], found["slider"]
    option = labels.get("option", next(o for o in dropdown.options if o != dropdown.value))
    assert option in dropdown.options and option != dropdown.value
    before = shown(panel)
    dropdown.value = option
    assert shown(panel) != before, f"{name}: {labels['dropdown']} -> {option} changed nothing"
    before = shown(panel)
    slider.value = min(slider.value + slider.step, slider.max)     # what ArrowRight does
    assert shown(panel) != before, f"{name}: {labels['slider']} +1 step changed nothing"
