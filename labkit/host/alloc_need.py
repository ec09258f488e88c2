"""What a replayed step needs from the device, read as a band: the caching allocator is not
monotonic in memory, so one bisected size is not "the" need.

With more room the allocator caches segments that can fragment later, so a replay can run on
one device and fail on a slightly larger one. ``allocator.min_capacity`` bisects one boundary
between running and failing; ``need_band`` scans a grid of devices around it and reports the
lowest that runs and the highest that fails:

    band = need_band(mv.events, AllocatorSettings(), step=4 * 2**20)
    band.low, band.high          # runs from low on some devices, on every scanned one from high
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.host.allocator import AllocatorSettings, CachingAllocator, feed, min_capacity, replay


@dataclass(frozen=True)
class NeedBand:
    """Devices, in bytes, on which a replay runs or fails, scanned in ``step`` bytes."""

    low: int                      # the smallest scanned device on which it runs
    high: int                     # the smallest scanned device above every failure (runs)
    bisected: int                 # min_capacity's answer (runs; at most ``step`` less failed)
    highest_failure: int | None   # the largest scanned device on which it fails
    step: int
    scanned: tuple[int, int]      # the first and last device scanned
    replays: int                  # replays the scan ran (the bisection's not counted)

    @property
    def width(self) -> int:
        return self.high - self.low


def need_band(events, settings: AllocatorSettings = AllocatorSettings(), step: int = 4 * 2**20,
              above: int = 0) -> NeedBand:
    """The band of devices between "runs on some" and "runs on every one scanned": bisect one
    boundary (``min_capacity``, to ``step``), then replay on every ``step`` below it down to the
    peak of allocated blocks (no smaller device can run) and on every ``step`` up to ``above``
    bytes over it. A failure above the scanned range is not seen: pass ``above`` to look there.
    Each scanned device costs one replay (``runs_on``, half a full replay's time or less): lab
    08's six steps take a few seconds per setting."""
    if not isinstance(step, int) or step <= 0:
        raise ValueError(f"step must be a positive number of bytes, got {step!r}: try 4 * 2**20")
    if not isinstance(above, int) or above < 0:
        raise ValueError(f"above must be a number of bytes >= 0, got {above!r}: 0 scans below "
                         "the bisected size only")
    bisected = min_capacity(events, settings, tolerance=step)
    floor = replay(events, settings, record_trace=False).peak_allocated
    grid = [bisected + k * step for k in range(-((bisected - floor) // step), above // step + 1)]
    runs = {c: c == bisected or runs_on(events, settings, c) for c in grid}
    failures = [c for c in grid if not runs[c]]
    worst = max(failures, default=None)
    low = min(c for c in grid if runs[c])
    high = min(c for c in grid if runs[c] and (worst is None or c > worst))
    return NeedBand(low, high, bisected, worst, step, (grid[0], grid[-1]), len(grid) - 1)


def runs_on(events, settings: AllocatorSettings, capacity: int) -> bool:
    """Whether ``replay(events, settings, capacity=capacity)`` runs without running out, keeping
    neither the series replay records nor the statistics (twice as fast: what a scan repeats)."""
    return feed(_ReservedOnly(settings, capacity, record_trace=False), events) is None


class _ReservedOnly(CachingAllocator):
    """The allocator counting reserved bytes only: the one statistic its decisions read (its
    out-of-memory message, which runs_on does not read, then shows 0 allocated)."""

    def _add(self, pool: str, *changes: tuple[str, int]):
        for stat, n in changes:
            if stat == "reserved_bytes":
                self.current["reserved_bytes", "all"] += n
