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
from labkit.core.gpus import GPU, gpu
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
    eight_bit: bool = False          # some tensor has 8-bit moments: the two maps are held

    @property
    def total(self) -> int:
        return self.paged + self.resident

    def __add__(self, other: "PagedState") -> "PagedState":
        """One optimizer's state over both groups of parameters (the maps once)."""
        maps = MAP_BYTES if self.eight_bit and other.eight_bit else 0
        return PagedState(self.paged + other.paged, self.resident + other.resident - maps,
                          self.paged_tensors + other.paged_tensors, self.tensors + other.tensors,
                          self.eight_bit or other.eight_bit)


def paged_state(numels: Iterable[int], bits: int = 8,
                min_8bit_size: int = MIN_8BIT_SIZE) -> PagedState:
    """Where PagedAdamW8bit (``bits`` 8) or PagedAdamW (32) keeps the state of parameters of
    ``numels`` numbers: 8-bit codes (1 byte) per moment from ``min_8bit_size`` numbers on, with
    an fp32 absmax per ``BLOCK`` and two shared 256-value maps; fp32 moments below that and in
    the 32-bit optimizer. Only the moments are ever paged."""
    check_choice("bits", bits, (8, 32))
    paged = resident = paged_tensors = tensors = 0
    eight_bit = False
    for n in numels:
        check_positive("numel", n)
        codes = bits == 8 and n >= min_8bit_size
        eight_bit |= codes
        moments = 2 * n * (1 if codes else 4)
        resident += 2 * 4 * math.ceil(n / BLOCK) if codes else 0               # absmax: device
        if n >= PAGED_MIN_NUMEL:
            paged, paged_tensors = paged + moments, paged_tensors + 1
        else:
            resident += moments
        tensors += 1
    return PagedState(paged, resident + (MAP_BYTES if eight_bit else 0), paged_tensors,
                      tensors, eight_bit)


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


def paging_seconds(paged: int, overshoot: int, device: GPU | str = "a100-80gb",
                   efficiency: float = 0.8) -> float:
    """Seconds a step spends moving state out and back in when its allocations overshoot the
    GPU by ``overshoot`` bytes: the driver evicts what they need, up to the ``paged`` bytes, and
    the step brings it back (prefetched tensor by tensor, a sync after each: no overlap), at
    ``efficiency`` of the GPU's PCIe bandwidth. A ceiling on speed, so a floor on time: migration
    driven by page faults runs slower. It repeats every step while PyTorch's caching allocator
    keeps the spike's segments (until they are released, e.g. ``torch.cuda.empty_cache()``)."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency!r}")
    return 2 * min(paged, max(overshoot, 0)) / (gpu(device).pcie_gbps * 1e9 * efficiency)
