"""GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers") beside round-to-nearest, on the weights of a trained ``small`` model.

Round-to-nearest (RTN) rounds every weight on its own. GPTQ rounds the columns of a layer's
weight (out x in) one input feature at a time and spreads each column's rounding error over the
columns not yet rounded, weighted by the inverse Hessian of the layer's output error,
H = 2 X^T X / N (X: the layer's inputs on a calibration batch). Where inputs are correlated
the remaining columns can cancel most of the error: the weights move further, the outputs
less. The column loop follows the paper's Algorithm 1: the upper Cholesky factor of H^-1,
updates deferred in lazy batches of ``block`` columns, act-order off.

The grid, shared by both: asymmetric (min-max, widened to hold 0) integers of ``bits`` bits,
one scale and one zero point per ``group`` input columns of a row, taken from the current
(already updated) weights when GPTQ reaches the group's first column. Stored: the codes packed
``bits`` to a byte's worth, an fp16 scale and a ``bits``-bit zero point per group (as GPTQ's
packed ``qzeros``): 4 + 16/64 + 4/64 = 4.3125 bits per parameter at 4 bits, group 64.

``compare`` quantises every nn.Linear of the blocks (embeddings and the LM head stay fp32, as
GPTQ leaves them) and reports bits, weight error and the model's loss per scheme.
"""
from __future__ import annotations

import copy
import functools
import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from labkit.core.config import preset
from labkit.quantisation.compress import compress_weight
from labkit.quantisation.quant import dequantize, quantize_int8, quantize_nf4
from labkit.training.step import bigram_corpus, make_optimizer, train_step
from labkit.transformer.model import build_model

METHODS = ("fp32", "int8 absmax per channel", "nf4", "rtn int4 g64", "gptq int4 g64")
CORPUS_VOCAB = 32       # tokens the corpus uses: its 128 bigrams are learnt in ~100 steps


# ----------------------------------------------------------------------------- the grid

@dataclass
class GroupQuantized:
    """A weight on an integer grid: w~[r, c] = (codes[r, c] - zeros[r, g]) * scales[r, g],
    g = c // group."""

    weight: torch.Tensor        # (out, in) fp32, dequantised
    codes: torch.Tensor         # (out, in) uint8 in 0 .. 2**bits - 1 (stored packed)
    scales: torch.Tensor        # (out, in / group) fp16
    zeros: torch.Tensor         # (out, in / group) uint8 in 0 .. 2**bits - 1 (stored packed)
    bits: int
    group: int

    @property
    def nbytes(self) -> int:
        """Exact stored bytes: codes and zero points at ``bits`` bits each, fp16 scales."""
        packed = math.ceil(self.codes.numel() * self.bits / 8)
        return packed + self.scales.numel() * 2 + math.ceil(self.zeros.numel() * self.bits / 8)


def _check(weight: torch.Tensor, bits: int, group: int):
    if weight.dim() != 2:
        raise ValueError(f"weight is (out, in) as nn.Linear.weight, got shape "
                         f"{tuple(weight.shape)}")
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must lie in 2..8 (codes are stored in uint8), got {bits}")
    if group <= 0 or weight.shape[1] % group:
        raise ValueError(f"group={group} must divide the {weight.shape[1]} input columns; pass "
                         "a divisor of in_features (64 and 128 are usual)")


def _grid(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max grid for each row of w (rows, n): fp16-exact scales (rows,), zeros (rows,)."""
    top = 2 ** bits - 1
    low, high = w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0)     # 0 on the grid
    scales = (high - low) / top
    scales = torch.where(scales > 0, scales, torch.ones_like(scales)).half().float()
    return scales, (-low / scales).round().clamp(0, top)


def _round(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int):
    """Codes and dequantised values of w (rows, n) on the grid (scales, zeros: (rows,))."""
    codes = ((w / scales[:, None]).round() + zeros[:, None]).clamp(0, 2 ** bits - 1)
    return codes, (codes - zeros[:, None]) * scales[:, None]


def rtn_quantize(weight: torch.Tensor, bits: int = 4, group: int = 64) -> GroupQuantized:
    """Round-to-nearest: every group of ``group`` input columns rounded on its own grid."""
    _check(weight, bits, group)
    out, cols = weight.shape
    groups = weight.detach().float().reshape(-1, group)                    # (out * G, group)
    scales, zeros = _grid(groups, bits)                                     # (out * G,)
    codes, values = _round(groups, scales, zeros, bits)
    return GroupQuantized(values.reshape(out, cols), codes.to(torch.uint8).reshape(out, cols),
                          scales.half().reshape(out, -1), zeros.to(torch.uint8).reshape(out, -1),
                          bits, group)


# ----------------------------------------------------------------------------- GPTQ

def gptq_quantize(weight: torch.Tensor, inputs: torch.Tensor, bits: int = 4, group: int = 64,
                  damp: float = 0.01, block: int = 128) -> GroupQuantized:
    """GPTQ on one layer: weight (out, in), inputs (N, in) the layer's calibration inputs.

    ``damp`` x mean(diag H) is added to H's diagonal (H is singular when N < in or features
    are dead); ``block`` columns are rounded before their error reaches the rest of W.
    """
    _check(weight, bits, group)
    if not damp > 0:
        raise ValueError(f"damp must be positive (GPTQ uses 0.01), got {damp}")
    if block <= 0 or block % group:
        raise ValueError(f"block={block} must be a positive multiple of group={group}, so that "
                         "a group's grid is taken from fully updated weights")
    out, cols = weight.shape
    x = inputs.detach().reshape(-1, inputs.shape[-1]).float()               # (N, in)
    if x.shape[1] != cols:
        raise ValueError(f"inputs have {x.shape[1]} features, the weight {cols} input columns")
    hessian = 2 * x.T @ x / x.shape[0]                                      # (in, in)
    mean_diag = hessian.diagonal().mean()
    hessian += damp * (mean_diag if mean_diag > 0 else 1.0) * torch.eye(cols, device=x.device)
    # H^-1 = U^T U: row i of U holds how column i's error moves the columns after it
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hessian)), upper=True)

    w = weight.detach().float().clone()                                     # (out, in), updated
    values, codes = torch.zeros_like(w), torch.zeros_like(w)
    scales, zeros = w.new_zeros(out, cols // group), w.new_zeros(out, cols // group)
    for start in range(0, cols, block):
        end = min(start + block, cols)
        lazy = w[:, start:end].clone()                                      # (out, b) this batch
        errors = torch.zeros_like(lazy)                                     # (out, b)
        for i in range(end - start):
            col = start + i
            if col % group == 0:                                            # new group: its grid
                g = col // group
                scales[:, g], zeros[:, g] = _grid(lazy[:, i:i + group], bits)
            code, value = _round(lazy[:, i:i + 1], scales[:, g], zeros[:, g], bits)  # (out, 1)
            codes[:, col], values[:, col] = code[:, 0], value[:, 0]
            errors[:, i] = (lazy[:, i] - value[:, 0]) / u[col, col]        # (out,)
            lazy[:, i:] -= errors[:, i:i + 1] * u[col, col:end][None, :]    # within the batch
        w[:, end:] -= errors @ u[start:end, end:]                           # the deferred update
    return GroupQuantized(values, codes.to(torch.uint8), scales.half(), zeros.to(torch.uint8),
                          bits, group)


# ----------------------------------------------------------------------------- one layer

def quantize_weight(method: str, weight: torch.Tensor,
                    inputs: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """(dequantised weight, stored bytes) of one weight by a scheme named as in ``METHODS``;
    "rtn intB gG" / "gptq intB gG" take any bits B in 2..8 and group G; "2:4 fp16" and
    "low-rank 25% fp16" (``labkit.quantisation.compress``) store fewer values, not fewer bits."""
    weight = weight.detach().float()
    if method.startswith(("2:4", "low-rank")):
        return compress_weight(method, weight)
    if method == "fp32":
        return weight.clone(), weight.numel() * 4
    if method == "int8 absmax per channel":
        q = quantize_int8(weight, "absmax", "channel")
        return dequantize(q), q.nbytes
    if method == "nf4":
        q = quantize_nf4(weight)                                    # block 64, double quant
        return dequantize(q), q.nbytes
    match = re.fullmatch(r"(rtn|gptq) int(\d+) g(\d+)", method)
    if match is None:
        raise ValueError(f"unknown method {method!r}; use one of {METHODS} (any bits and group "
                         "in 'rtn int3 g128' / 'gptq int3 g128', or "
                         "labkit.quantisation.compress.METHODS)")
    kind, bits, group = match[1], int(match[2]), int(match[3])
    if kind == "rtn":
        q = rtn_quantize(weight, bits, group)
    elif inputs is None:
        raise ValueError("GPTQ needs the layer's calibration inputs (N, in): pass inputs")
    else:
        q = gptq_quantize(weight, inputs, bits, group)
    return q.weight, q.nbytes


# ----------------------------------------------------------------------------- a whole model

class _Captured(Exception):
    """Raised by the capture hook: the forward pass need not go past the layer."""


def layer_inputs(model: nn.Module, layer: nn.Linear, tokens: torch.Tensor) -> torch.Tensor:
    """What ``layer`` receives when ``model`` runs on tokens (B, T): (B * T, in_features)."""
    seen = []

    def capture(module, args):
        seen.append(args[0].detach().reshape(-1, args[0].shape[-1]))
        raise _Captured

    handle = layer.register_forward_pre_hook(capture)
    try:
        with torch.no_grad():
            model(tokens)
    except _Captured:
        pass
    finally:
        handle.remove()
    return seen[0]                                                          # (B * T, in)


@dataclass
class QuantizedModel:
    """A copy of the model with every block linear's weight replaced by its dequantised one."""

    model: nn.Module
    nbytes: int                 # stored bytes of the quantised linears
    numel: int                  # their parameters
    error_sq: float             # sum over them of ||W - W~||_F^2
    norm_sq: float              # sum over them of ||W||_F^2

    @property
    def bits_per_param(self) -> float:
        return 8 * self.nbytes / self.numel

    @property
    def weight_error(self) -> float:
        """Relative Frobenius error over all quantised linears: ||W - W~|| / ||W||."""
        return math.sqrt(self.error_sq / self.norm_sq)


def _block_linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.blocks.modules() if isinstance(m, nn.Linear)]


def quantize_model(model: nn.Module, method: str, calibration_tokens: torch.Tensor
                   ) -> QuantizedModel:
    """Quantise every nn.Linear inside ``model.blocks`` of a copy (LM head, embeddings fp32).

    Sequential, as GPTQ: layers in forward order, each calibrated on the inputs it gets from
    the copy as quantised so far, so a layer's rounding can correct its predecessors' errors.
    """
    quantized = copy.deepcopy(model).eval()
    linears = _block_linears(quantized)
    nbytes = numel = 0
    error_sq = norm_sq = 0.0
    for linear in linears:
        inputs = (layer_inputs(quantized, linear, calibration_tokens)
                  if method.startswith("gptq") else None)
        weight = linear.weight.detach().float()
        values, stored = quantize_weight(method, weight, inputs)           # (out, in), bytes
        nbytes, numel = nbytes + stored, numel + weight.numel()
        error_sq += (weight - values).pow(2).sum().item()
        norm_sq += weight.pow(2).sum().item()
        with torch.no_grad():
            linear.weight.copy_(values)
    return QuantizedModel(quantized, nbytes, numel, error_sq, norm_sq)


# ----------------------------------------------------------------------------- the trained model

@dataclass
class TrainedModel:
    model: nn.Module            # shared by the cache: quantise copies, never it
    losses: list[float]         # training loss per step
    calibration: torch.Tensor   # (16, seq + 1) corpus rows not trained on
    held_out: torch.Tensor      # (32, seq + 1) other rows, for evaluation


@functools.lru_cache(maxsize=4)
def trained_small(steps: int = 100, seed: int = 0, batch: int = 8, seq: int = 32,
                  lr: float = 3e-3) -> TrainedModel:
    """``small`` trained in fp32 with AdamW on ``bigram_corpus`` over CORPUS_VOCAB tokens
    (best loss ln 4 = 1.386; ~1.7 after 100 steps, 10-20 s on 2 cores); cached."""
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    torch.manual_seed(seed)
    model = build_model(preset("small"))
    optimizer = make_optimizer(model.parameters(), "adamw", lr=lr)
    n_train, n_calibration, n_held_out = steps * batch, 16, 32
    n_rows = n_train + n_calibration + n_held_out
    rows = bigram_corpus(CORPUS_VOCAB, n_rows * (seq + 1), seed).view(n_rows, seq + 1)
    batches = rows[:n_train].view(steps, batch, seq + 1)                    # (steps, B, T+1)
    losses = [train_step(model, optimizer, b[:, :-1], b[:, 1:]).loss for b in batches]
    return TrainedModel(model.eval(), losses, rows[n_train:n_train + n_calibration],
                        rows[n_train + n_calibration:])


def output_error(model: nn.Module, quantized: nn.Module, tokens: torch.Tensor) -> float:
    """Relative error of the quantised block linears' outputs on what the original model feeds
    them: sqrt(sum ||X (W - W~)^T||^2 / sum ||X W^T||^2) over layers, GPTQ's objective."""
    error_sq = norm_sq = 0.0
    pairs = zip(_block_linears(model), _block_linears(quantized))
    for linear, approx in pairs:
        x = layer_inputs(model, linear, tokens)                             # (B * T, in)
        with torch.no_grad():
            exact = x @ linear.weight.T                                     # (B * T, out)
            error_sq += (exact - x @ approx.weight.T).pow(2).sum().item()
            norm_sq += exact.pow(2).sum().item()
    return math.sqrt(error_sq / norm_sq)


def eval_loss(model: nn.Module, tokens: torch.Tensor) -> float:
    """Mean next-token loss of model on tokens (B, T + 1)."""
    with torch.no_grad():
        return model(tokens[:, :-1], tokens[:, 1:]).item()


@dataclass
class CompareRow:
    method: str
    bits_per_param: float       # exact: 8 x stored bytes / parameters of the quantised linears
    weight_error: float         # relative Frobenius error over the quantised linears
    output_error: float         # their outputs' relative error on held-out inputs (output_error)
    loss: float                 # held-out loss of the quantised model
    loss_increase: float        # loss - the fp32 model's loss


def compare(methods=METHODS, trained: TrainedModel | None = None) -> list[CompareRow]:
    """One row per scheme on the trained ``small`` model: bits, weight and layer-output error,
    held-out loss."""
    trained = trained or trained_small()
    base = eval_loss(trained.model, trained.held_out)
    rows = []
    for method in methods:
        q = quantize_model(trained.model, method, trained.calibration[:, :-1])
        loss = eval_loss(q.model, trained.held_out)
        outputs = output_error(trained.model, q.model, trained.held_out[:, :-1])
        rows.append(CompareRow(method, q.bits_per_param, q.weight_error, outputs, loss,
                               loss - base))
    return rows
