"""Pipeline parallelism: which layers each stage holds, and how many micro-batches of
activations it keeps (Narayanan et al., 2021). Lab 05 adds the schedules and the executor."""
from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def stage_layers(layers: int, pp: int) -> list[range]:
    """Layer indices of each of ``pp`` stages: contiguous, non-empty, sizes differing by at
    most one (the first stages take the extra layers). 32 layers over pp=6: 6,6,5,5,5,5."""
    if not 1 <= pp <= layers:
        raise ValueError(f"pp={pp} must be between 1 and layers={layers}; a pipeline stage needs "
                         f"at least one layer")
    base, extra = divmod(layers, pp)
    bounds = [0]
    for s in range(pp):
        bounds.append(bounds[-1] + base + (s < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def in_flight(stage: int, pp: int, micro_batches: int, schedule: str = "1f1b") -> int:
    """Micro-batches whose activations stage ``stage`` holds at once: GPipe runs every
    forward first (all ``micro_batches``); 1F1B starts backward after ``pp - stage``."""
    if schedule == "gpipe":
        return micro_batches
    return min(micro_batches, pp - stage)
