"""Lab 06's panel: scheme, bits and block -> bits per parameter and error."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import ipywidgets as w
import torch

from labkit.core.config import preset
from labkit.core.units import check_choice
from labkit.course.panel_reports import PanelResult
from labkit.course.plot import bits_error_figure
from labkit.course.widgets.base import _render
from labkit.predict.layers import count_params
from labkit.quantisation.gptq import gptq_quantize, rtn_quantize
from labkit.quantisation.quant import dequantize, quantize_int8, quantize_nf4


QUANT_SCHEMES = ("int8 absmax", "int8 zero-point", "nf4", "rtn", "gptq")
QUANT_BLOCKS = (32, 64, 128, 256)                 # values per scale (rtn / gptq: columns per grid)
INT8_GRANULARITIES = ("tensor", "channel")        # int8 only: one scale per tensor or per row
FIXED_BITS = {"int8 absmax": 8, "int8 zero-point": 8, "nf4": 4}
WEIGHT_SHAPE = (256, 1024)                        # (out, in) of the default weight, N(0, 0.02)
CALIBRATION_ROWS, CALIBRATION_RANK = 1024, 64     # GPTQ's inputs: near a rank-64 subspace
SEVEN_B = "llama-2-7b"
QUANT_SWEEP = [("int8 absmax", 8, "tensor", False), ("int8 absmax", 8, "channel", False),
               ("nf4", 4, 64, False), ("nf4", 4, 64, True),
               *((kind, bits, 64, False) for kind in ("rtn", "gptq") for bits in (2, 3, 4, 8))]


@functools.lru_cache(maxsize=4)
def quant_inputs(features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded correlated layer inputs, near one rank-64 subspace plus 0.1 noise, as a
    transformer's activations are: (calibration, held-out), each (1024, features). GPTQ is
    calibrated on the first; output errors are measured on the second."""
    g = torch.Generator().manual_seed(0)
    mixing = torch.randn(CALIBRATION_RANK, features, generator=g)              # (64, in)
    low_rank = torch.randn(2 * CALIBRATION_ROWS, CALIBRATION_RANK, generator=g) @ mixing
    inputs = low_rank + 0.1 * torch.randn(2 * CALIBRATION_ROWS, features, generator=g)
    return inputs[:CALIBRATION_ROWS], inputs[CALIBRATION_ROWS:]                # (N, in) each


def default_weight() -> torch.Tensor:
    """The panel's weight: seeded N(0, 0.02), (256, 1024) as nn.Linear.weight (out x in)."""
    return torch.randn(WEIGHT_SHAPE, generator=torch.Generator().manual_seed(0)) * 0.02


@dataclass
class QuantResult(PanelResult):
    """One weight quantised: exact stored bits per parameter, the relative errors of the weight
    and of the layer's outputs, and what all of a 7B model's weights take at that format."""

    label: str = ""
    nbytes: int = 0                      # stored bytes of the quantised weight
    numel: int = 0
    weight_error: float = 0.0            # relative ||W - W~||_F / ||W||_F
    output_error: float = 0.0            # ||X (W - W~)^T||_F / ||X W^T||_F, held-out inputs
    model_bytes: float = 0.0             # SEVEN_B's parameters, every one at this format

    @property
    def bits_per_param(self) -> float:
        return 8 * self.nbytes / self.numel

    def summary(self) -> str:
        if self.error:
            return f"⚠ {self.error}"
        gptq = (f"; GPTQ calibrated on {CALIBRATION_ROWS} other seeded inputs from the same "
                f"rank-{CALIBRATION_RANK} subspace" if self.label.startswith("gptq") else "")
        return "\n".join([
            f"{self.label}: {self.nbytes:,} bytes for {self.numel:,} weights = "
            f"{self.bits_per_param:.4f} bits ({self.bits_per_param / 8:.4f} bytes) per parameter",
            f"relative error: weight {self.weight_error:.4f}, layer output {self.output_error:.4f} "
            f"(held-out correlated inputs){gptq}",
            f"{SEVEN_B}'s {count_params(preset(SEVEN_B)).total / 1e9:.2f} B parameters at this "
            f"format: {self.model_bytes / 2**30:.2f} GiB (bf16: "
            f"{count_params(preset(SEVEN_B)).total * 2 / 2**30:.2f} GiB)"])


def quant_label(scheme: str, bits: int, block, double_quant: bool = False) -> str:
    """The name a setting goes by in the text and the figure: "rtn int4 g64", "nf4 b64 dq"."""
    if scheme.startswith("int8"):
        return f"{scheme} per {block}" if block in INT8_GRANULARITIES else f"{scheme} b{block}"
    if scheme == "nf4":
        return f"nf4 b{block}" + (" dq" if double_quant else "")
    return f"{scheme} int{bits} g{block}"


def _check_quant_setting(scheme: str, bits: int, block, double_quant: bool) -> None:
    check_choice("scheme", scheme, QUANT_SCHEMES)
    fixed = FIXED_BITS.get(scheme)
    if fixed is not None and bits != fixed:
        raise ValueError(f"{scheme} stores {fixed}-bit codes: set bits to {fixed}, or choose rtn "
                         f"or gptq for {bits} bits")
    if block in INT8_GRANULARITIES and not scheme.startswith("int8"):
        raise ValueError(f"one scale per {block} is an int8 option here: choose a block of "
                         f"{', '.join(map(str, QUANT_BLOCKS))} for {scheme}")
    if double_quant and scheme != "nf4":
        raise ValueError("double quantisation stores NF4's block scales in 8 bits: choose nf4, "
                         "or turn it off")


def _quantize(scheme: str, bits: int, block, double_quant: bool,
              weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(dequantised weight, stored bytes) of one setting, by labkit.quantisation's ``quant`` or
    ``gptq``."""
    if scheme.startswith("int8"):
        granularity = block if block in INT8_GRANULARITIES else "block"
        q = quantize_int8(weight, scheme.removeprefix("int8 "), granularity,
                          block if granularity == "block" else 64)
        return dequantize(q), q.nbytes
    if scheme == "nf4":
        q = quantize_nf4(weight, block, double_quant)
        return dequantize(q), q.nbytes
    if scheme == "rtn":
        q = rtn_quantize(weight, bits, block)
    else:                                        # lazy batches must hold whole groups
        inputs, _ = quant_inputs(weight.shape[1])
        q = gptq_quantize(weight, inputs, bits, block, block=max(128, block))
    return q.weight, q.nbytes


def quant_report(scheme: str, bits: int, block, double_quant: bool = False,
                 weight: torch.Tensor | None = None) -> QuantResult:
    """``weight`` (default: ``default_weight()``) quantised by ``scheme`` (QUANT_SCHEMES) at
    ``bits`` with one scale per ``block`` values (int8 also "tensor" or "channel"): exact bits
    per parameter, relative errors, a 7B model's bytes; an impossible setting in ``.error``."""
    weight = default_weight() if weight is None else weight.detach().float()
    try:
        _check_quant_setting(scheme, bits, block, double_quant)
        if weight.dim() != 2:
            raise ValueError(f"weight is (out, in) as nn.Linear.weight, got shape "
                             f"{tuple(weight.shape)}")
        approx, nbytes = _quantize(scheme, bits, block, double_quant, weight)   # (out, in)
    except ValueError as error:
        return QuantResult(error=str(error))
    _, held_out = quant_inputs(weight.shape[1])                                 # (N, in)
    output_error = (held_out @ (weight - approx).T).norm() / (held_out @ weight.T).norm()
    return QuantResult(label=quant_label(scheme, bits, block, double_quant), nbytes=nbytes,
                       numel=weight.numel(),
                       weight_error=((weight - approx).norm() / weight.norm()).item(),
                       output_error=output_error.item(),
                       model_bytes=count_params(preset(SEVEN_B)).total * nbytes / weight.numel())


@functools.lru_cache(maxsize=1)
def quant_reference() -> tuple[QuantResult, ...]:
    """``quant_report`` of every QUANT_SWEEP setting on the default weight (~1.5 s, once)."""
    return tuple(quant_report(*setting) for setting in QUANT_SWEEP)


class QuantPanel:
    """Scheme, bits, block and double quantisation -> bits per parameter, the weight's and the
    layer output's error, a 7B model's bytes, and the point among a reference sweep."""

    def __init__(self, scheme: str = "nf4", bits: int | None = None, block=64,
                 double_quant: bool = True):
        check_choice("scheme", scheme, QUANT_SCHEMES)
        check_choice(f"block for {scheme}", block, self._blocks(scheme))
        bits = bits or FIXED_BITS.get(scheme, 4)         # None: the scheme's own width, or 4
        self.scheme = w.Dropdown(options=QUANT_SCHEMES, value=scheme, description="scheme")
        self.bits = w.IntSlider(value=bits, min=2, max=8, description="bits")
        self.block = w.Dropdown(options=self._blocks(scheme), value=block, description="block")
        self.double_quant = w.Checkbox(value=double_quant, description="double quantisation",
                                       disabled=scheme != "nf4")
        self.output = w.Output()
        self.result: QuantResult | None = None
        self.reference = quant_reference()
        self._syncing = False
        self.scheme.observe(self._on_scheme, names="value")
        for control in (self.bits, self.block, self.double_quant):
            control.observe(lambda _: self._syncing or self.update(), names="value")
        self.widget = w.VBox([w.HBox([self.scheme, self.bits]),
                              w.HBox([self.block, self.double_quant]), self.output])
        self.update()

    @staticmethod
    def _blocks(scheme: str) -> tuple:
        return QUANT_BLOCKS + (INT8_GRANULARITIES if scheme.startswith("int8") else ())

    def _on_scheme(self, change):
        scheme = change["new"]
        self._syncing = True                     # one update for the scheme's controls
        self.bits.value = FIXED_BITS.get(scheme, self.bits.value)
        block = self.block.value
        self.block.options = self._blocks(scheme)
        self.block.value = block if block in self.block.options else 64
        self.double_quant.disabled = scheme != "nf4"
        self._syncing = False
        self.update()

    def update(self) -> QuantResult:
        scheme = self.scheme.value
        result = quant_report(scheme, self.bits.value, self.block.value,
                              self.double_quant.value and scheme == "nf4")
        self.result = result
        if result.error:
            _render(self.output, result.summary())
            return result
        rows = [(r.label, r.bits_per_param, r.output_error) for r in self.reference]
        labels = [row[0] for row in rows]
        if result.label not in labels:
            rows.append((result.label, result.bits_per_param, result.output_error))
            labels.append(result.label)
        _render(self.output, result.summary(), bits_error_figure(
            rows, highlight=labels.index(result.label),
            ylabel="layer output error ||X(W - W~)ᵀ|| / ||XWᵀ||",
            title=f"{result.label} among the reference settings (weight {WEIGHT_SHAPE[0]} x "
                  f"{WEIGHT_SHAPE[1]}, held-out correlated inputs)"))
        return result


def quant_panel(**defaults) -> w.VBox:
    """The quantisation panel of lab 06 (``QuantPanel`` holds its state and callbacks)."""
    return QuantPanel(**defaults).widget
