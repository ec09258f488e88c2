"""Lab 08's panel: what the CUDA caching allocator reserves for a step."""
from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as w

from labkit.core.recipe import PRECISIONS
from labkit.core.units import check_choice, fmt_bytes
from labkit.course.plot import allocator_figure
from labkit.course.widgets.base import _render, _wire
from labkit.host.allocator import AllocatorSettings, replay
from labkit.training.measure import measure_step


ALLOCATOR_MODELS = ("tiny", "small", "tiny-moe")
ALLOCATORS = {"native": AllocatorSettings(),
              "expandable segments": AllocatorSettings(expandable_segments=True)}


@dataclass
class AllocatorResult:
    """Two steps of a course model on fake tensors (CUDA's defaults) replayed through the
    caching allocator under each setting; ``allocator`` is the one the summary leads with."""

    model: str = ""
    allocator: str = "native"
    batch: int = 0
    seq: int = 0
    precision: str = ""
    tracker_peak: int = 0
    replays: dict | None = None
    error: str | None = None

    def summary(self) -> str:
        if self.error:
            return f"⚠ {self.error}"
        chosen = self.replays[self.allocator]
        others = ", ".join(f"{label} {fmt_bytes(r.peak_reserved)}"
                           for label, r in self.replays.items() if label != self.allocator)
        over = chosen.peak_reserved / chosen.peak_allocated - 1
        return (f"{self.model}, {self.precision}, two steps of batch {self.batch} x {self.seq} "
                f"(fake tensors, CUDA's defaults): the tensors peak at "
                f"{fmt_bytes(self.tracker_peak)}.\n{self.allocator}: the allocator reserves "
                f"{fmt_bytes(chosen.peak_reserved)} at its peak, {100 * over:.1f}% over its "
                f"allocated blocks ({fmt_bytes(chosen.peak_allocated)}); {others}.")


def allocator_report(model: str, *, batch: int, seq: int, precision: str = "bf16-mixed",
                     allocator: str = "native") -> AllocatorResult:
    """Measure two steps' storage events and replay them under each of ``ALLOCATORS``; an
    impossible setting is explained in ``.error``."""
    try:
        check_choice("allocator", allocator, ALLOCATORS)
        check_choice("model", model, ALLOCATOR_MODELS)
        m = measure_step(model, batch, seq, precision=precision, fake=True, device="cuda",
                         events=True, then=[(batch, seq)])
    except ValueError as error:
        return AllocatorResult(error=str(error))
    replays = {label: replay(m.events, settings) for label, settings in ALLOCATORS.items()}
    return AllocatorResult(model, allocator, batch, seq, precision, m.total, replays)


class AllocatorPanel:
    """Model, precision, batch and seq -> two training steps' blocks and what the caching
    allocator reserves for them, with and without expandable segments."""

    def __init__(self, model: str = "small", precision: str = "bf16-mixed", batch: int = 4,
                 seq: int = 256, allocator: str = "native"):
        self.model = w.Dropdown(options=ALLOCATOR_MODELS, value=model, description="model")
        self.precision = w.Dropdown(options=PRECISIONS, value=precision, description="precision")
        self.allocator = w.Dropdown(options=list(ALLOCATORS), value=allocator,
                                    description="allocator")
        # each change measures two steps: update on release, not on every tick of a drag
        self.batch = w.IntSlider(value=batch, min=1, max=16, description="batch",
                                 continuous_update=False)
        self.seq = w.IntSlider(value=seq, min=32, max=1024, step=32, description="seq",
                               continuous_update=False)
        self.result: AllocatorResult | None = None
        _wire(self, [[self.model, self.precision, self.allocator], [self.batch, self.seq]])

    def update(self) -> AllocatorResult:
        result = allocator_report(self.model.value, batch=self.batch.value, seq=self.seq.value,
                                  precision=self.precision.value, allocator=self.allocator.value)
        self.result = result
        if result.error:
            _render(self.output, result.summary())
        else:
            chosen = {result.allocator: result.replays[result.allocator]}
            others = {k: v for k, v in result.replays.items() if k != result.allocator}
            _render(self.output, result.summary(), allocator_figure({**chosen, **others}))
        return result


def allocator_panel(**defaults) -> w.VBox:
    """The caching-allocator panel of lab 08 (``AllocatorPanel`` holds its state)."""
    return AllocatorPanel(**defaults).widget
