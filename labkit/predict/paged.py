"""Paged optimizers, QLoRA's third part: which of a bitsandbytes paged AdamW's state lives in
CUDA unified memory, so that the driver can move it to the host when the GPU runs short, and
what moving it costs. Torch-free byte rules from bitsandbytes 0.50's source
(``Optimizer8bit.get_state_buffer``), checked against its optimizer's state on the CPU, where
it does not page (tests/test_paged_optimizer.py)."""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from labkit.core.config import ModelConfig, preset
from labkit.core.units import check_choice, check_positive
from labkit.predict.formats import BLOCK, MAP_BYTES, MIN_8BIT_SIZE
from labkit.predict.layers import (block_weights, embedding_weights, head_weights,
                                   lora_weights)

# a parameter of fewer numbers keeps its moments in plain device memory ("> 1 MB" in the source)
PAGED_MIN_NUMEL = 100_000


@dataclass(frozen=True)
class PagedState:
    """Bytes of a paged AdamW's state: ``paged`` in unified memory (the two moments of each
    parameter of ``PAGED_MIN_NUMEL`` numbers or more), ``resident`` on the device (smaller
    parameters' moments, every absmax scale, the two 8-bit maps)."""

    paged: int
    resident: int
    paged_tensors: int
    tensors: int

    @property
    def total(self) -> int:
        return self.paged + self.resident


def paged_state(numels: Iterable[int], bits: int = 8) -> PagedState:
    """Where PagedAdamW8bit (``bits`` 8) or PagedAdamW (32) keeps the state of parameters of
    ``numels`` numbers: 8-bit codes (1 byte) per moment from ``MIN_8BIT_SIZE`` numbers on, with
    an fp32 absmax per ``BLOCK``; fp32 moments below that and in the 32-bit optimizer."""
    check_choice("bits", bits, (8, 32))
    paged = resident = paged_tensors = tensors = 0
    for n in numels:
        check_positive("numel", n)
        eight_bit = bits == 8 and n >= MIN_8BIT_SIZE
        moments = 2 * n * (1 if eight_bit else 4)
        resident += 2 * 4 * math.ceil(n / BLOCK) if eight_bit else 0          # absmax: device
        if n >= PAGED_MIN_NUMEL:
            paged, paged_tensors = paged + moments, paged_tensors + 1
        else:
            resident += moments
        tensors += 1
    return PagedState(paged, resident + (MAP_BYTES if bits == 8 and tensors else 0),
                      paged_tensors, tensors)


def trained_numels(cfg: ModelConfig | str, trainable: str = "lora", r: int = 16) -> list[int]:
    """The numbers of each tensor the optimizer updates: every LoRA A and B at rank ``r``
    (labkit's targets: every linear of the blocks but the routed experts,
    ``layers.lora_targets``), or every trained parameter (``trainable="all"``; labkit stacks a
    layer's routed experts in one tensor)."""
    check_choice("trainable", trainable, ("lora", "all"))
    c = preset(cfg) if isinstance(cfg, str) else cfg
    if trainable == "lora":
        return [w.numel for layer in range(c.layers)
                for w in lora_weights(c, layer >= c.dense_layers, r)]
    weights = embedding_weights(c) + head_weights(c) + [
        w for layer in range(c.layers) for w in block_weights(c, layer >= c.dense_layers)]
    return [w.numel for w in weights if w.trains]


def paging_seconds(nbytes: int, pcie_gbps: float = 25.0) -> float:
    """Seconds to move ``nbytes`` out to the host and back in, once each, at ``pcie_gbps``
    GB/s (PCIe 4.0 x16 sustains about 25 of its 32): what a step pays when its state is evicted
    in the forward and backward passes and fetched again for the update."""
    if not pcie_gbps > 0:
        raise ValueError(f"pcie_gbps must be a bandwidth above 0 (GB/s), got {pcie_gbps!r}")
    return 2 * nbytes / (pcie_gbps * 1e9)
