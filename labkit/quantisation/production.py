"""labkit's quantisers beside the production libraries, where they are installed (lab 06).

One nn.Linear weight goes through labkit and through bitsandbytes (Dettmers et al.: NF4
``Linear4bit``, ``Linear8bitLt``, the 8-bit blockwise ``AdamW8bit``) and torchao (int8
weight-only). For each: the bytes it keeps, counted from the tensors it holds (not from a
formula), and how far its weight and its output move from fp32 (``side_by_side``); then, code
by code, where labkit and the library disagree, and why (``agreement``).

Both libraries are optional (the ``production`` extra) and imported only when used: without
them this module still imports, ``available()`` names what is missing, and every function
returns the labkit rows alone.

Layers run in training mode, the QLoRA setting: on a CPU, bitsandbytes 0.50 then dequantises
the weight and multiplies in fp32. In eval mode it does otherwise: ``Linear8bitLt`` quantises
the activations too (LLM.int8()), and on a CPU with AVX512-BF16 ``Linear4bit`` repacks its
weight at the first forward and keeps its block scales as bf16 (double quantisation undone).
"""
from __future__ import annotations

import importlib
import logging
import math
import warnings
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from labkit.quantisation import optim8bit, quant

PACKAGES = ("bitsandbytes", "torchao")
DQ_BLOCK = 256                  # double quantisation: block scales per second-level scale


# ----------------------------------------------------------------------------- what is installed

def _load(name: str):
    """Import ``name`` and check the API used here. Both libraries log warnings at import on a
    CPU-only machine (GPU kernels not found): silenced, they are not errors."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(name)
            if name == "bitsandbytes":
                module.nn.Linear4bit, module.nn.Linear8bitLt, module.optim.AdamW8bit  # noqa: B018
            else:
                importlib.import_module("torchao.quantization").Int8WeightOnlyConfig  # noqa: B018
    finally:
        logging.disable(previous)
    return module


def _probe(name: str) -> tuple[str | None, str | None]:
    """(version, None) when ``name`` works here, else (None, the reason)."""
    try:
        module = _load(name)
    except ModuleNotFoundError as error:
        if error.name == name:
            return None, f"not installed ({error}); pip install -e '.[production]'"
        return None, f"unusable: {error}"               # a missing dependency or submodule
    except Exception as error:                          # a broken build, an older API
        return None, f"unusable: {type(error).__name__}: {error}"
    return getattr(module, "__version__", "unknown"), None


def available() -> dict[str, str | None]:
    """Package -> its version, or None when it is absent or unusable (``unavailable`` says why)."""
    return {name: _probe(name)[0] for name in PACKAGES}


def unavailable() -> dict[str, str]:
    """Package -> why it cannot be used, for the packages that cannot."""
    return {name: reason for name in PACKAGES if (reason := _probe(name)[1]) is not None}


def _library(name: str):
    """The module, or None where it cannot be used: the caller then leaves its rows out."""
    try:
        return _load(name)
    except Exception:                                   # ``unavailable()`` says why
        return None


# ----------------------------------------------------------------------------- bytes held

def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors behind ``t``. A tensor subclass (torchao's ``Int8Tensor``) reports a
    placeholder storage of its nominal dtype (fp32 here: 4 bytes a weight); its bytes are in
    the tensors it flattens into."""
    if type(t) in (torch.Tensor, nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [plain for name in names for plain in _plain(getattr(t, name))]


def _attached(obj, seen: set) -> list[torch.Tensor]:
    """Tensors hung on bitsandbytes' objects: ``Int8Params.CB/SCB``, ``Params4bit.quant_state``
    (absmax, codebooks, the nested state), ``Linear8bitLt.state`` (CB/SCB after a forward)."""
    found = []
    for value in vars(obj).values():
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif (type(value).__module__.startswith("bitsandbytes") and hasattr(value, "__dict__")
              and not isinstance(value, nn.Module) and id(value) not in seen):
            seen.add(id(value))
            found += _attached(value, seen)
    return found


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a storage shared twice counts once)."""
    storages = {}
    for t in tensors:
        for plain in _plain(t):
            storage = plain.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def module_bytes(module: nn.Module) -> int:
    """What a layer keeps: its parameters and buffers and every tensor hung on them."""
    held, seen = [], set()
    for t in [*module.parameters(), *module.buffers()]:
        held += [t, *_attached(t, seen)]
    if type(getattr(module, "state", None)).__module__.startswith("bitsandbytes"):
        held += _attached(module.state, seen)
    return storage_bytes(held)


# ----------------------------------------------------------------------------- the layers

@dataclass
class Layer:
    """A weight to quantise and the inputs its layer sees."""

    name: str
    weight: torch.Tensor        # (out, in) fp32, as nn.Linear.weight
    inputs: torch.Tensor        # (N, in) fp32


def trained_layer() -> Layer:
    """``mlp.w_up`` of block 0 of the trained ``small`` model (labkit.quantisation.gptq), on
    the inputs it gets from the calibration rows: real weights and activations (~10 s the
    first time)."""
    from labkit.quantisation.gptq import layer_inputs, trained_small
    trained = trained_small()
    linear = trained.model.blocks[0].mlp.w_up
    inputs = layer_inputs(trained.model, linear, trained.calibration[:, :-1])   # (512, 256)
    return Layer("small block 0 mlp.w_up (trained)", linear.weight.detach().clone(), inputs)


def synthetic_layer(out_features: int = 512, in_features: int = 256, rows: int = 64,
                    seed: int = 0) -> Layer:
    """Gaussian weights N(0, 1/in) (what NF4's levels are made for) and N(0, 1) inputs."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g) / math.sqrt(in_features)
    return Layer(f"synthetic {out_features}x{in_features}", weight,
                 torch.randn(rows, in_features, generator=g))


def _linear(weight: torch.Tensor, cls=nn.Linear, **options) -> nn.Module:
    """A bias-free ``cls`` layer holding ``weight``; bitsandbytes' quantise on ``.to("cpu")``."""
    if weight.dim() != 2:
        raise ValueError(f"weight is (out, in) as nn.Linear.weight, got shape "
                         f"{tuple(weight.shape)}")
    layer = cls(weight.shape[1], weight.shape[0], bias=False, **options)
    layer.load_state_dict({"weight": weight.detach().float().clone()})
    return layer.to("cpu")


# ----------------------------------------------------------------------------- weights

@dataclass
class SideBySide:
    """One implementation of one scheme on one layer. Weight rows: ``weight_error`` is
    ||W~ - W|| / ||W|| of the stored weight, ``output_error`` ||y~ - y|| / ||y|| of the layer's
    own forward. Optimizer rows: the state after the steps; ``weight_error`` is the error of
    the weight's total update, ``output_error`` the larger of the moments' errors, both against
    torch's fp32 AdamW."""

    scheme: str
    implementation: str
    stored_bytes: int           # counted from the tensors the implementation keeps
    bits_per_param: float       # 8 x stored_bytes / weights
    weight_error: float
    output_error: float
    layer: str = ""


def _relative(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx.float() - exact.float()).norm() / exact.float().norm()).item()


def weight_rows(layer: Layer) -> list[SideBySide]:
    """fp32, NF4 + double quantisation and int8 per channel, by labkit and by each library
    installed: bytes kept, weight error and output error on the layer's inputs."""
    weight, x = layer.weight.detach().float(), layer.inputs.float()
    exact = x @ weight.T                                                    # (N, out)
    measured = []                       # (scheme, implementation, module or bytes, W~, forward)

    fp32 = _linear(weight)
    measured.append(("fp32", "torch nn.Linear", fp32, weight, fp32))
    nf4 = quant.QuantLinear(_linear(weight), double_quant=True, dq_block=DQ_BLOCK)
    measured.append(("nf4 + double quant", "labkit QuantLinear", nf4,
                     quant.dequantize(nf4.quantized()), nf4))
    q8 = quant.quantize_int8(weight, "absmax", "channel")
    measured.append(("int8 absmax per channel", "labkit quantize_int8",
                     storage_bytes([q8.codes, q8.scales]), quant.dequantize(q8),
                     lambda x: F.linear(x, quant.dequantize(q8))))

    bnb = _library("bitsandbytes")
    if bnb is not None:
        name = f"bitsandbytes {bnb.__version__}"
        l4 = _linear(weight, bnb.nn.Linear4bit, compute_dtype=torch.float32,
                     compress_statistics=True, quant_type="nf4")
        measured.append(("nf4 + double quant", f"{name} Linear4bit", l4,
                         bnb.functional.dequantize_4bit(l4.weight.data, l4.weight.quant_state),
                         l4))
        l8 = _linear(weight, bnb.nn.Linear8bitLt, has_fp16_weights=False, threshold=0.0)
        measured.append(("int8 absmax per channel", f"{name} Linear8bitLt", l8,
                         bnb.functional.int8_vectorwise_dequant(l8.weight.CB, l8.weight.SCB), l8))
    ao = _library("torchao")
    if ao is not None:
        ao_linear = _torchao_int8(weight)
        measured.append(("int8 absmax per channel", f"torchao {ao.__version__} "
                         "Int8WeightOnlyConfig", ao_linear, ao_linear.weight.dequantize(),
                         ao_linear))

    rows = []
    for scheme, implementation, kept, dequantised, forward in measured:
        with torch.no_grad():
            out = forward(x)                                                # (N, out)
        stored = kept if isinstance(kept, int) else module_bytes(kept)      # after the forward
        rows.append(SideBySide(scheme, implementation, stored, 8 * stored / weight.numel(),
                               _relative(dequantised, weight), _relative(out, exact),
                               layer.name))
    return rows


def _torchao_int8(weight: torch.Tensor) -> nn.Module:
    """An nn.Linear whose weight torchao has made int8 weight-only (one scale per row)."""
    _load("torchao")                                    # quietly, the first time
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    linear = _linear(weight)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_(linear, Int8WeightOnlyConfig())
    return linear


# ----------------------------------------------------------------------------- optimizers

def _gradients(shape, steps: int, seed: int) -> torch.Tensor:
    """(steps, *shape) Gaussian gradients of std 1e-3, the same for every optimizer."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(steps, *shape, generator=g) * 1e-3


def _train(make, weight: torch.Tensor, grads: torch.Tensor):
    """(parameter, optimizer) after one step per gradient, from ``weight``."""
    param = nn.Parameter(weight.detach().float().clone())
    optimizer = make([param])
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    return param, optimizer


def _moments(param: torch.Tensor, optimizer) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (m, v) of ``param``, dequantised from whichever state the optimizer keeps."""
    state = optimizer.state[param]
    if "exp_avg" in state:                                                  # torch AdamW
        return state["exp_avg"], state["exp_avg_sq"]
    if "m_codes" in state:                                                  # labkit
        return (optim8bit.dequantize_blockwise(state["m_codes"], state["m_absmax"],
                                               optimizer.signed_map),
                optim8bit.dequantize_blockwise(state["v_codes"], state["v_absmax"],
                                               optimizer.unsigned_map))
    return (optim8bit.dequantize_blockwise(state["state1"], state["absmax1"], state["qmap1"]),
            optim8bit.dequantize_blockwise(state["state2"], state["absmax2"], state["qmap2"]))


def _optimizers() -> dict:
    """implementation -> a maker of AdamW with the same hyperparameters, for what is installed."""
    options = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    makers = {"torch AdamW (fp32)": lambda p: torch.optim.AdamW(p, foreach=False, **options),
              "labkit AdamW8bit": lambda p: optim8bit.AdamW8bit(p, **options)}
    bnb = _library("bitsandbytes")
    if bnb is not None:
        makers[f"bitsandbytes {bnb.__version__} AdamW8bit"] = \
            lambda p: bnb.optim.AdamW8bit(p, **options)
    return makers


def optimizer_rows(layer: Layer, steps: int = 5, seed: int = 0) -> list[SideBySide]:
    """AdamW's state for the layer's weight after ``steps`` steps on the same gradients, by
    torch (fp32), labkit and bitsandbytes: bytes kept, and errors against fp32 AdamW."""
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    grads = _gradients(layer.weight.shape, steps, seed)
    runs = {name: _train(make, layer.weight, grads) for name, make in _optimizers().items()}
    reference_param, reference = runs["torch AdamW (fp32)"]
    update = reference_param.detach() - layer.weight
    m_ref, v_ref = _moments(reference_param, reference)
    rows = []
    for name, (param, optimizer) in runs.items():
        stored = optim8bit.optimizer_state_bytes(optimizer)      # every state storage, once
        m, v = _moments(param, optimizer)
        scheme = "AdamW state" if optimizer is reference else "AdamW 8-bit blockwise state"
        rows.append(SideBySide(scheme, name, stored, 8 * stored / layer.weight.numel(),
                               _relative(param.detach() - layer.weight, update),
                               max(_relative(m, m_ref), _relative(v, v_ref)), layer.name))
    return rows


# ----------------------------------------------------------------------------- code by code

@dataclass
class Agreement:
    """labkit against a library on the same numbers: how many stored codes differ, how far
    apart the numbers they stand for are, and why."""

    what: str
    implementation: str
    codes_differing: int
    codes: int
    max_abs_difference: float   # of the dequantised numbers
    relative_difference: float  # ||labkit - library|| / ||library||
    why: str                    # "" where they agree exactly
    layer: str = ""


BINSEARCH = ("bitsandbytes' CPU quantize_blockwise (a BinSearch lookup) takes the farther of "
             "two codes for values within ~3e-5 of their midpoint")


def _nf4_bnb_map(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """labkit NF4 whose block scales are double-quantised as bitsandbytes does it: minus their
    mean, on the 8-bit dynamic map in blocks of 256. (dequantised weight, scale codes)."""
    q = quant.quantize_nf4(weight, double_quant=False)
    mean = q.scales.mean()
    codes, absmax = optim8bit.quantize_blockwise(q.scales - mean, optim8bit.dynamic_map(True),
                                                 DQ_BLOCK)
    q.scales = optim8bit.dequantize_blockwise(codes, absmax, optim8bit.dynamic_map(True),
                                              DQ_BLOCK) + mean
    return quant.dequantize(q), codes


def agreement(layer: Layer, steps: int = 5, seed: int = 0) -> list[Agreement]:
    """Where labkit's codes and numbers differ from each installed library's on one layer."""
    weight = layer.weight.detach().float()
    rows = []

    def add(what, implementation, mine, theirs, mine_codes, their_codes, why):
        rows.append(Agreement(what, implementation, int((mine_codes != their_codes).sum()),
                              their_codes.numel(), (mine - theirs).abs().max().item(),
                              _relative(mine, theirs), why, layer.name))

    bnb = _library("bitsandbytes")
    if bnb is not None:
        name = f"bitsandbytes {bnb.__version__}"
        l4 = {}                                     # double quant? -> (layer, its weight)
        for double_quant in (False, True):
            layer4 = _linear(weight, bnb.nn.Linear4bit, compute_dtype=torch.float32,
                             compress_statistics=double_quant, quant_type="nf4")
            l4[double_quant] = (layer4, bnb.functional.dequantize_4bit(
                layer4.weight.data, layer4.weight.quant_state))             # (out, in)
            q = quant.quantize_nf4(weight, double_quant=double_quant, dq_block=DQ_BLOCK)
            add(f"nf4 codes and weight, {'double quant' if double_quant else 'fp32 scales'}",
                f"{name} Linear4bit", quant.dequantize(q), l4[double_quant][1],
                quant.unpack_4bit(q.codes), quant.unpack_4bit(layer4.weight.data),
                "scales double-quantised by labkit as int8 absmax (lab 06), by bitsandbytes on "
                "its 8-bit dynamic map" if double_quant else "")
        mine, scale_codes = _nf4_bnb_map(weight)
        layer4, theirs = l4[True]
        add("nf4 weight, double quant on bitsandbytes' map: scale codes", f"{name} Linear4bit",
            mine, theirs, scale_codes, layer4.weight.quant_state.absmax, BINSEARCH)
        l8 = _linear(weight, bnb.nn.Linear8bitLt, has_fp16_weights=False, threshold=0.0)
        q8 = quant.quantize_int8(weight, "absmax", "channel")
        add("int8 absmax per channel", f"{name} Linear8bitLt", quant.dequantize(q8),
            bnb.functional.int8_vectorwise_dequant(l8.weight.CB, l8.weight.SCB), q8.codes,
            l8.weight.CB, "bitsandbytes rounds the weight to fp16 before quantising it")
        grads = _gradients(weight.shape, steps, seed)
        makers = _optimizers()
        (mine_p, mine_opt), (their_p, their_opt) = (
            _train(makers[key], weight, grads)
            for key in ("labkit AdamW8bit", f"{name} AdamW8bit"))
        for i, moment in enumerate(("m", "v")):
            add(f"AdamW 8-bit {moment} after {steps} steps", f"{name} AdamW8bit",
                _moments(mine_p, mine_opt)[i], _moments(their_p, their_opt)[i],
                mine_opt.state[mine_p][f"{moment}_codes"],
                their_opt.state[their_p][f"state{i + 1}"], BINSEARCH)
    ao = _library("torchao")
    if ao is not None:
        q8 = quant.quantize_int8(weight, "absmax", "channel")
        theirs = _torchao_int8(weight).weight
        add("int8 absmax per channel", f"torchao {ao.__version__} Int8WeightOnlyConfig",
            quant.dequantize(q8), theirs.dequantize(), q8.codes, theirs.qdata,
            "torchao scales by absmax / 127.5 and rounds onto -128 ... 127 (a row's largest "
            "positive weight loses half a step), with an int8 zero point (0) per row")
    return rows


# ----------------------------------------------------------------------------- all of it

def side_by_side(layers: list[Layer] | None = None, steps: int = 5) -> list[SideBySide]:
    """Weight and optimizer rows for each layer (default: the trained ``small`` layer and a
    synthetic one), for labkit and each library installed (``unavailable()``: the others)."""
    layers = [trained_layer(), synthetic_layer()] if layers is None else layers
    return [row for layer in layers for row in weight_rows(layer) + optimizer_rows(layer, steps)]


def _cell(value) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:.4g}"


def format_rows(rows: list, missing: dict[str, str] | None = None) -> str:
    """A plain-text table of dataclass rows (``SideBySide`` or ``Agreement``), then a line for
    each package left out (pass ``unavailable()``)."""
    if not rows:
        table = "(no rows)"
    else:
        names = [f.name for f in fields(rows[0])]
        cells = [names] + [[_cell(getattr(row, name)) for name in names] for row in rows]
        widths = [max(len(line[i]) for line in cells) for i in range(len(names))]
        table = "\n".join("  ".join(c.rjust(w) if c[:1].isdigit() else c.ljust(w)
                                    for c, w in zip(line, widths)).rstrip() for line in cells)
    return "\n".join([table] + [f"not measured: {name}: {why}"
                                for name, why in (missing or {}).items()])
