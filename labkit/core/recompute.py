"""Which blocks recompute under each policy: the policies' names and their plans. Torch-free:
the estimate reads it; the mechanism is ``labkit.transformer.checkpointing``, whose docstring
describes each policy."""
from __future__ import annotations

import math
from dataclasses import dataclass

RECOMPUTE_POLICIES = ("none", "selective", "every-k", "sqrt", "full")


@dataclass(frozen=True)
class Unit:
    """Blocks ``first`` .. ``last - 1`` run together; ``recompute``: checkpointed as one unit."""

    first: int
    last: int
    recompute: bool


def parse_policy(policy: str, every: int = 2) -> tuple[str, int]:
    """(policy name, k) from ``"every-k"`` + ``every``, ``"every-3"``, or another name."""
    name, k = policy, every
    if isinstance(policy, str) and policy.startswith("every-") and policy[6:].isdigit():
        name, k = "every-k", int(policy[6:])
    if name not in RECOMPUTE_POLICIES:
        raise ValueError(f"unknown recompute policy {policy!r}; use one of "
                         f"{', '.join(RECOMPUTE_POLICIES)} (or 'every-3' for k=3)")
    if name == "every-k" and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise ValueError(f"every must be a positive whole number of blocks, got {k!r}; "
                         f"every=1 recomputes every block (the same as 'full')")
    return name, k


def plan(layers: int, policy: str = "none", every: int = 2) -> list[Unit]:
    """The units a model of ``layers`` blocks runs under ``policy``, in order."""
    name, k = parse_policy(policy, every)
    if name == "sqrt":
        size = max(1, round(math.sqrt(layers)))
        return [Unit(i, min(i + size, layers), True) for i in range(0, layers, size)]
    recompute = {"none": lambda i: False, "full": lambda i: True,
                 "selective": lambda i: True, "every-k": lambda i: (i + 1) % k == 0}[name]
    return [Unit(i, i + 1, recompute(i)) for i in range(layers)]
