"""The estimate's vocabulary: a named tensor alive at a moment, the estimate it adds up to, and
how a moment's tensors add up (host memory, where offload keeps ZeRO's shards, is not counted)."""
from __future__ import annotations

from dataclasses import dataclass, field

from labkit.core.units import CATEGORIES, HOST, Breakdown, fmt_bytes


@dataclass(frozen=True)
class Tensor:
    """Bytes of one kind of tensor alive at a moment, with what it is."""

    name: str
    category: str
    dtype: str
    nbytes: int


@dataclass
class Estimate(Breakdown):
    """Predicted bytes per device at the step's peak. ``tensors``: what is alive then, by name;
    ``moments``: every candidate moment's total (the peak is the largest)."""

    moments: dict = field(default_factory=dict)
    tensors: list = field(default_factory=list)

    def explain(self) -> str:
        """The tensors alive at the peak, largest first, one per line; then what the estimate
        assumes (``details["assumes"]``)."""
        rows = sorted(self.tensors, key=lambda t: -t.nbytes)
        width = max(len(t.name) for t in rows)
        lines = [f"{t.name:<{width}}  {CATEGORIES.get(t.category, 'host memory'):<22} {t.dtype:<11}"
                 f"{fmt_bytes(t.nbytes):>12}" for t in rows if t.nbytes]
        return "\n".join(lines + [f"assumes: {a}" for a in self.details.get("assumes", [])])


def _total(tensors: list[Tensor]) -> int:
    """Device bytes: what is offloaded to the host is not counted."""
    return sum(t.nbytes for t in tensors if t.category != HOST)


def _by_category(tensors: list[Tensor]) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    for t in tensors:
        if t.category != HOST:
            out[t.category] += t.nbytes
    return out
