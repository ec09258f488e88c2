"""Bytes of the number formats the mechanisms store, as rules the estimate reads: NF4 blocks
(QLoRA) and 8-bit AdamW's blockwise codes. Torch-free; the mechanisms are
``labkit.quantisation.quant`` and ``labkit.quantisation.optim8bit``, whose tests check these rules
byte for byte."""
from __future__ import annotations

import math

BLOCK = 256                # numbers per absmax: bitsandbytes 0.50's optimizers (the paper: 2048)
MIN_8BIT_SIZE = 4096       # smaller parameters keep fp32 moments (bitsandbytes' min_8bit_size)
CHUNK = 2 ** 24            # numbers updated at once: the step's temporaries scale with it


def nf4_bits_per_param(block: int = 64, double_quant: bool = True, dq_block: int = 256) -> float:
    """QLoRA's overhead formula: 4 + 32/block, or 4 + 8/block + 32/(block * dq_block) with
    double quantisation (4.127 bits at the defaults); a tensor adds 32 bits for the mean."""
    if not double_quant:
        return 4 + 32 / block
    return 4 + 8 / block + 32 / (block * dq_block)


# ---- 8-bit AdamW (labkit.quantisation.optim8bit.AdamW8bit) -------------------------------
def eight_bit_state_bytes(numel: int, block: int = BLOCK,
                          min_8bit_size: int = MIN_8BIT_SIZE) -> int:
    """Bytes of AdamW8bit's two moments for one parameter of ``numel`` numbers (no maps)."""
    if numel < min_8bit_size:
        return 2 * 4 * numel                                                 # fp32 m and v
    return 2 * (numel + 4 * math.ceil(numel / block))                        # codes + absmax


MAP_BYTES = 2 * 256 * 4                  # the two maps' fp32 values: optimizer state
LOOKUP_BYTES = 2 * (256 * 4 + 2 ** 16)   # their midpoints and prefix tables: "other"


def step_temporary_bytes(numel: int, weight_bytes: int = 4, block: int = BLOCK,
                         min_8bit_size: int = MIN_8BIT_SIZE, chunk: int = CHUNK) -> int:
    """Peak bytes AdamW8bit's step allocates and frees for one parameter of ``numel`` numbers
    whose weights and gradient take ``weight_bytes`` each (fp32 copies of them when 2).

    Per number of a chunk: the fp32 m and v (8), then requantising one of them (normalised in
    place): its 16-bit prefix (4), the lower code (1), that code widened (4) and its midpoint
    (4), 17 in all, plus the chunk's absmax and scales (8 per block). Before requantising,
    m, v and sqrt(v) (12), with 16-bit weights and the fp32 weights and gradient (20).
    fp32 moments (``numel`` < ``min_8bit_size``) are updated in place: sqrt(v) (+ the copies).
    A chunk ending in a partial block also pads a copy of the moment (exact to ~1 KB).
    """
    size = min(numel, chunk)
    copies = 0 if weight_bytes == 4 else 8
    if numel < min_8bit_size:
        return (4 + copies) * size
    blocks = math.ceil(size / block)
    padded = 4 * blocks * block if size % block else 0
    return max((12 + copies) * size, 17 * size + 8 * blocks + padded)
