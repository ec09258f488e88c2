"""LoRA and QLoRA on labkit's model: freeze it, then put a trainable low-rank adapter beside
every linear layer of the blocks (Hu et al., 2021), on an NF4 base for QLoRA (Dettmers et al.,
2023). The layers themselves (``LoRALinear``, ``QuantLinear``) live in
``labkit.quantisation.quant``.

What is targeted ("all-linear", as QLoRA and PEFT do): every ``nn.Linear`` of every block -
attention projections, dense and shared-expert SwiGLUs - but the MoE router, which PEFT's
"all-linear" leaves alone too (Hugging Face's DeepSeek gate is no ``nn.Linear``). The embedding,
the norms, the router and the LM head stay frozen in the precision's dtype, unquantised, as
QLoRA keeps them; labkit's routed experts are one stacked tensor, not ``nn.Linear`` layers,
so they stay frozen and unquantised too. ``labkit.predict.layers.lora_targets`` is the same rule on
the estimate's side.
"""
from __future__ import annotations

import torch
from torch import nn

from labkit.core.units import check_choice, check_positive
from labkit.quantisation.quant import LoRALinear, QuantLinear

TARGETS = ("all-linear",)
WEIGHT_FORMATS = (None, "nf4")


def is_target(name: str, module: nn.Module) -> bool:
    """Whether "all-linear" adapts this module of a block: an ``nn.Linear``, not the router."""
    return isinstance(module, nn.Linear) and name.split(".")[-1] != "router"


def apply_lora(model: nn.Module, r: int = 16, alpha: float | None = None,
               targets: str = "all-linear", weight_format: str | None = None,
               dtype: torch.dtype | None = None) -> int:
    """Freeze ``model`` (labkit's ``Transformer``) and wrap each targeted linear of its blocks
    in a ``LoRALinear`` (alpha: 2 r unless given) - over a ``QuantLinear`` base when
    ``weight_format="nf4"`` (QLoRA). Adapters A, B take ``dtype`` (default: the embedding's,
    the precision's weight dtype). Returns the number of trainable parameters."""
    check_positive("r", r)
    alpha = 2 * r if alpha is None else alpha
    check_choice("lora targets", targets, TARGETS)
    check_choice("weight_format", weight_format, WEIGHT_FORMATS)
    if not hasattr(model, "blocks"):
        raise ValueError(f"apply_lora adapts labkit's Transformer (model.blocks), got "
                         f"{type(model).__name__}; for another model use its own LoRA (PEFT)")
    dtype = dtype or model.embed.weight.dtype
    model.requires_grad_(False)
    for block in model.blocks:
        for name, module in list(block.named_modules()):
            if not is_target(name, module):
                continue
            base = QuantLinear(module) if weight_format == "nf4" else module
            lora = LoRALinear(base, r, alpha)
            if lora.A.dtype != dtype:     # an NF4 base has no float weight: LoRALinear picks fp32
                lora.A = nn.Parameter(lora.A.detach().to(dtype))
                lora.B = nn.Parameter(lora.B.detach().to(dtype))
            parent, _, child = name.rpartition(".")
            setattr(block.get_submodule(parent) if parent else block, child, lora)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def finetune(model: nn.Module, steps: int = 40, trainable: str = "lora", r: int = 16,
             weight_format: str | None = None, modules_to_save: tuple[str, ...] = (),
             lr: float = 3e-3, seed: int = 1, batch: int = 8, seq: int = 32,
             progress: bool = True) -> list[float]:
    """Fine-tune a copy of ``model`` (``gptq.trained_small()``'s, say) on a new task - the
    bigram corpus of another seed, whose successors differ - fully (``trainable="all"``) or
    through rank-``r`` adapters on a float or NF4 base; the loss per step (fp32 AdamW).
    ``modules_to_save`` (as PEFT's): modules trained whole beside the adapters, e.g.
    ("embed", "lm_head"). ``progress`` shows a bar over the steps."""
    import copy

    from tqdm.auto import tqdm

    from labkit.quantisation.gptq import CORPUS_VOCAB
    from labkit.training.step import bigram_corpus, make_optimizer, train_step

    check_choice("trainable", trainable, ("all", "lora"))
    check_positive("steps", steps)
    model = copy.deepcopy(model).train()
    if trainable == "lora":
        apply_lora(model, r, weight_format=weight_format)
    elif weight_format is not None or modules_to_save:
        raise ValueError("weight_format and modules_to_save go with adapters: pass "
                         "trainable='lora' with them")
    for name in modules_to_save:
        model.get_submodule(name).requires_grad_(True)      # AttributeError names a bad one
    torch.manual_seed(seed)                                 # the adapters' A start alike
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, "adamw", lr=lr)
    rows = bigram_corpus(CORPUS_VOCAB, steps * batch * (seq + 1), seed)
    batches = rows.view(steps, batch, seq + 1)                              # (steps, B, T+1)
    if trainable == "all":
        what = "all weights"
    else:                                           # e.g. "LoRA r=16 on nf4 + embed + lm_head"
        what = f"LoRA r={r}" + (f" on {weight_format}" if weight_format else "")
        what += "".join(f" + {name}" for name in modules_to_save)
    return [train_step(model, optimizer, b[:, :-1], b[:, 1:]).loss
            for b in tqdm(batches, desc=f"fine-tuning {what}", disable=not progress)]
