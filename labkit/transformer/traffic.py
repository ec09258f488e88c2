"""What attention reads and writes in GPU memory (HBM), counted as FlashAttention's papers count
it (lab 07): standard attention against the tiled kernels, for the on-chip memory of real GPUs
(``SRAM_PER_SM``). A model: no causal skipping, no L2 cache, the forward pass only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.core.units import check_choice, check_positive

TILE = 128          # queries and keys per tile: real kernels' 64-128, labkit's tiled core's default


@dataclass(frozen=True)
class Sram:
    """On-chip memory of one GPU: per streaming multiprocessor (SM), and how many SMs."""

    sms: int
    per_sm: int           # bytes: L1 cache and shared memory together (the paper's "SRAM")
    shared_per_sm: int    # bytes of it a kernel may use as shared memory, at most


KiB = 1024
# A100: "192KB of on-chip SRAM per each of 108 streaming multiprocessors" (FlashAttention
# paper, section 2.1); of it up to 164 KB shared memory per SM (NVIDIA Ampere tuning guide,
# "Unified Shared Memory/L1/Texture Cache"). H100 SXM5: 132 SMs with 256 KB of combined L1
# and shared memory each, up to 228 KB of it shared (NVIDIA Hopper tuning guide; Modal's GPU
# glossary, "L1 data cache": 256 KiB per SM x 132 SMs). H200: the same GH100 chip and SMs as
# the H100 SXM, with more and faster HBM (141 GB HBM3e).
SRAM_PER_SM = {
    "A100": Sram(sms=108, per_sm=192 * KiB, shared_per_sm=164 * KiB),
    "H100 SXM": Sram(sms=132, per_sm=256 * KiB, shared_per_sm=228 * KiB),
    "H200": Sram(sms=132, per_sm=256 * KiB, shared_per_sm=228 * KiB),
}


LOOP_ORDERS = ("fa2", "fa1")      # query blocks outside (FlashAttention-2, labkit's), or keys


def fitted_block(d: int, sram_bytes: int, bytes_per_number: int = 2) -> int:
    """The largest square block of B rows whose Q_i, K_j, V_j, O_i (B x d each) and scores
    (B x B) fit in ``sram_bytes`` of on-chip memory: 4Bd + B^2 <= M numbers."""
    on_chip = sram_bytes // bytes_per_number                                # M, in numbers
    return max(1, math.isqrt(4 * d * d + on_chip) - 2 * d)      # (B + 2d)^2 <= M + 4d^2


def hbm_accesses(n: int, d: int, sram_bytes: int, impl: str, bytes_per_number: int = 2,
                 loop_order: str = "fa2", block: int | None = None, dv: int | None = None) -> int:
    """Numbers one head's *forward* attention reads and writes in GPU memory (HBM), counted as
    the algorithms of Dao et al. move them: a model (no causal skipping, no L2 cache, the
    backward pass not counted). Theorem 2 of FlashAttention (2022) states them as
    Theta(N d + N^2) and Theta(N^2 d^2 / M). Multiply by ``bytes_per_number`` for bytes.

    "naive" (the paper's Algorithm 0): read Q, K, write S (2Nd + N^2); read S, write P (2N^2);
    read P, V, write O (N^2 + 2Nd): 4Nd + 4N^2, whatever the SRAM.
    "tiled", in square blocks of B rows (``block``; None: ``fitted_block``, the largest that
    fits the M = sram_bytes / bytes_per_number numbers on chip; real kernels use 64-128):
    - ``loop_order="fa2"`` (FlashAttention-2 (2023), Algorithm 1; the order labkit's
      ``TiledAttention`` and ``flash_triton`` run): each of the T_r = ceil(N / B) query
      blocks reads its Q_i once, streams all of K and V, and writes O_i and its log-sum-exp
      once: Nd + T_r 2Nd + Nd + N. The ratio to naive tends to 2B / d.
    - ``loop_order="fa1"`` (FlashAttention, Algorithm 1): K and V are read once (2Nd); for
      each of the T_c = ceil(N / B) key blocks every query block reads Q_i, O_i, l_i, m_i
      and writes O_i, l_i, m_i: 2Nd + T_c (3Nd + 4N). The ratio tends to 4B / 3d.
    ``dv``: the width of V and O when it differs from that of Q and K (DeepSeek-V2: d = 192,
    dv = 128); each V or O term above then counts dv numbers per row, and a fitted block must
    hold 2B(d + dv) + B^2 numbers. None: dv = d, the formulas above.
    """
    check_choice("attention implementation (for HBM accesses)", impl, ("naive", "tiled"))
    check_choice("loop order", loop_order, LOOP_ORDERS)
    dv = d if dv is None else dv
    for name, value in (("n", n), ("d", d), ("dv", dv), ("sram_bytes", sram_bytes),
                        ("bytes_per_number", bytes_per_number)):
        check_positive(name, value)
    if impl == "naive":                            # Q, K: n d each; V, O: n dv each; S, P: 4 n^2
        return 2 * n * d + 2 * n * dv + 4 * n * n
    if block is not None:
        check_positive("block", block)
    elif dv == d:
        block = fitted_block(d, sram_bytes, bytes_per_number)
    else:                                          # 2B(d + dv) + B^2 <= M, as fitted_block
        width = d + dv
        block = max(1, math.isqrt(width * width + sram_bytes // bytes_per_number) - width)
    passes = math.ceil(n / block)                                            # T_r (or T_c)
    if loop_order == "fa1":                        # K, V once; per pass Q_i read, O_i read + written
        return n * d + n * dv + passes * (n * d + 2 * n * dv + 4 * n)
    return n * d + passes * n * (d + dv) + n * dv + n   # Q once, K and V per pass, O and lse once



def hbm_ratio(seq: int, head_dim: int, gpu: str) -> float:
    """Standard attention's HBM reads and writes over FlashAttention's for one head's forward
    pass (``labkit.transformer.attention.hbm_accesses``) with one SM's on-chip memory of ``gpu``."""
    sram = SRAM_PER_SM[gpu].per_sm
    return (hbm_accesses(seq, head_dim, sram, "naive")
            / hbm_accesses(seq, head_dim, sram, "tiled"))


def hbm_ratio_tiles(seq: int, head_dim: int, block: int = TILE) -> float:
    """Standard attention's HBM reads and writes over FlashAttention-2's for one head's forward
    pass in tiles of ``block`` query rows (``hbm_accesses``, no L2 cache): real kernels use 64 to
    128 rows whatever the GPU, so this ratio is the same on every GPU; it tends to 2B / d."""
    return (hbm_accesses(seq, head_dim, 1, "naive")
            / hbm_accesses(seq, head_dim, 1, "tiled", block=block))


def hbm_ratio_all_l2_hits(seq: int, head_dim: int) -> float:
    """The same ratio if every re-read of K and V hits the L2 cache, none HBM: the tiled pass then
    reads Q, K, V and writes O and its log-sum-exp once (4Nd + N, ``hbm_accesses`` in one block
    of all N rows) against standard attention's 4Nd + 4N^2, a ratio that tends to 1 + N / d."""
    return (hbm_accesses(seq, head_dim, 1, "naive")
            / hbm_accesses(seq, head_dim, 1, "tiled", block=seq))
