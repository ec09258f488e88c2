"""What each technique of the course saves, each in a regime where it matters (lab 09's summary).

One row per technique: the per-GPU peak of a LLaMA-2-7B training step without it and with it,
from ``labkit.estimate`` (CUDA's defaults) or, for the allocator, from a replayed step
(``labkit.host.allocator``). The regimes differ on purpose - a technique's saving depends on where
the step's peak sits (lab 02: at batch 1 the optimizer step sets it, and checkpointing saves
nothing there) - so each row names its own, as its lab measured it.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.core.recipe import Layout, Recipe
from labkit.predict import estimate


@dataclass(frozen=True)
class Saving:
    """Peak bytes per GPU of one step without and with a technique, in the regime named."""

    technique: str
    lab: str
    regime: str
    before: int
    after: int

    @property
    def saved(self) -> float:
        """The share of the peak the technique removes (negative: it costs memory)."""
        return 1 - self.after / self.before


def _peak(model: str, batch: int, seq: int, recipe: Recipe, layout: Layout = Layout()) -> int:
    return estimate(model, batch, seq, recipe=recipe, layout=layout).total


def course_savings(model: str = "llama-2-7b", allocator_steps: bool = True) -> list[Saving]:
    """The course's techniques on ``model``, each before -> after in its lab's regime.
    ``allocator_steps`` adds lab 08's row: six steps of a 4-layer model of ``model``'s shapes
    with sequence lengths that vary, replayed (about ten seconds on fake tensors)."""
    master, fp32 = Recipe("bf16-master"), Recipe("fp32")
    one = f"{model}, 1 x 4096, one GPU"
    rows = [
        Saving("bf16 weights, gradients and AdamW state (pure bf16) vs fp32", "02", one,
               _peak(model, 1, 4096, fp32), _peak(model, 1, 4096, Recipe("bf16"))),
        Saving("full activation checkpointing", "03", f"{model}, 8 x 4096, ZeRO-3 over 8",
               _peak(model, 8, 4096, master, Layout(dp=8, zero_stage=3)),
               _peak(model, 8, 4096, Recipe("bf16-master", recompute="full"),
                     Layout(dp=8, zero_stage=3))),
        Saving("ZeRO-3 over 8 GPUs vs DDP", "04", f"{model}, 1 x 4096, bf16-master",
               _peak(model, 1, 4096, master, Layout(dp=8)),
               _peak(model, 1, 4096, master, Layout(dp=8, zero_stage=3))),
        Saving("tensor parallel 8 with sequence parallelism", "05",
               f"{model}, 1 x 4096, bf16-master", _peak(model, 1, 4096, master),
               _peak(model, 1, 4096, master, Layout(tp=8, sp=True))),
        Saving("8-bit AdamW vs torch's fused AdamW (no step temporaries)", "06",
               f"{one}, bf16-master", _peak(model, 1, 4096, Recipe("bf16-master",
                                                                   optimizer_impl="fused")),
               _peak(model, 1, 4096, Recipe("bf16-master", "adamw-8bit"))),
        Saving("QLoRA (NF4 base, rank-16 adapters) vs full fine-tuning", "06",
               f"{one}, bf16-master -> bf16 adapters", _peak(model, 1, 4096, master),
               _peak(model, 1, 4096, Recipe("bf16", trainable="lora", weight_format="nf4"))),
        Saving("FlashAttention (SDPA) vs naive attention", "07",
               f"{model}, 1 x 4096, bf16-master, ZeRO-3 over 8",
               _peak(model, 1, 4096, Recipe("bf16-master", attention="naive"),
                     Layout(dp=8, zero_stage=3)),
               _peak(model, 1, 4096, master, Layout(dp=8, zero_stage=3))),
    ]
    if allocator_steps:
        rows.append(_expandable_segments(model))
    return rows


def _expandable_segments(model: str) -> Saving:
    """Lab 08: what six steps of varying length need with and without expandable segments. The
    allocator is not monotonic in memory, so each need is a band (``alloc_need.need_band``, 4 MiB
    steps): the row takes the least saving, from the smallest device on which the native
    allocator runs to the one from which expandable segments ran on every device scanned."""
    from labkit.host.alloc_need import need_band
    from labkit.host.allocator import AllocatorSettings
    from labkit.core.config import preset
    from labkit.training.measure import measure_step

    seqs = (1024, 2048, 1536, 4096, 3072, 2560)
    cfg = preset(model).replace(layers=4, name=f"{model}, 4 layers")
    m = measure_step(cfg, 1, seqs[0], precision="bf16-mixed", fake=True, device="cuda",
                     events=True, then=[(1, s) for s in seqs[1:]])
    band = {exp: need_band(m.events, AllocatorSettings(expandable_segments=exp), step=4 * 2**20,
                           above=64 * 2**20) for exp in (False, True)}
    return Saving("expandable segments (device memory the steps need)", "08",
                  f"{cfg.name}, six steps of 1 x 1024-4096; the least saving of lab 08's bands",
                  band[False].low, band[True].high)
