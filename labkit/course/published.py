"""Published training runs, each estimated with its own techniques: runs that fitted their GPUs,
and where Hugging Face's QLoRA runs out of memory.

The planner is only as good as the estimate under it: each run here is a configuration its
authors ran, with the recipe and layout they published, so the estimate must put it under its
GPU's memory (less the planner's headroom). DeepSeek-V3's own layout (expert parallelism with
ZeRO-1 over the data-parallel ranks) is estimated apart: it trains in FP8, which labkit does
not model, so in bf16 it fits only with full recomputation. Hugging Face's longest QLoRA
sequence per card (``HF_LONGEST``) is where memory runs out: it shows how far the estimate is
too low as well as too high.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.core.config import ModelConfig, preset
from labkit.core.gpus import gpu as gpu_named, usable_memory
from labkit.core.recipe import Layout, Recipe
from labkit.predict import estimate
from labkit.predict.sweep import first

GIB = 2 ** 30

# LLaMA-1 65B (Touvron et al., 2023, Table 2): 80 layers of 8192, 64 heads without GQA, an
# SwiGLU width of 22016 and 2048-token context; no preset, only this check uses it
LLAMA_65B = preset("llama-2-70b", kv_heads=64, ffn=22016, max_seq=2048).replace(
    name="llama-65b", published="LLaMA-1 65B (Touvron et al., 2023)")


@dataclass(frozen=True)
class PublishedRun:
    """One run as published: its model, GPU type and count, per-GPU batch and sequence, and
    the recipe and layout that say how it trained."""

    name: str
    source: str
    model: str | ModelConfig
    gpu: str
    gpus: int
    batch: int                # sequences per GPU per micro-batch
    seq: int
    recipe: Recipe
    layout: Layout = Layout()
    note: str = ""

    def check(self) -> dict:
        """The estimate's bytes per GPU against the GPU's usable memory."""
        est = estimate(self.model, self.batch, self.seq, recipe=self.recipe, layout=self.layout)
        usable = usable_memory(gpu_named(self.gpu))
        return dict(name=self.name, per_gpu=est.total, usable=usable,
                    fits=est.total <= usable, peak=est.details["peak moment"])


RUNS = (
    PublishedRun(
        "Guanaco-65B: QLoRA on one 48 GB GPU",
        "Dettmers et al., QLoRA (2023), and its scripts/finetune_guanaco_65b.sh (86ac601): NF4 "
        "with double quantisation, rank-64 LoRA on every linear, bf16, gradient checkpointing, "
        "1 sequence (16 accumulated) of at most 16 + 512 tokens",
        LLAMA_65B, "a6000-48gb", 1, 1, 528,
        Recipe("bf16", recompute="full", trainable="lora", lora_rank=64, weight_format="nf4"),
        note="the paper's paged 32-bit AdamW keeps the adapters' moments in fp32 (2.98 GiB "
             "more) and pages them to host memory under pressure; labkit's are bf16"),
    PublishedRun(
        "Alpaca: LLaMA-7B fully fine-tuned with FSDP on 4 x A100-80GB",
        "Taori et al., Stanford Alpaca (2023), README: FSDP full_shard per decoder layer, bf16, "
        "4 sequences of 512 tokens per GPU, no gradient checkpointing",
        "llama-2-7b", "a100-80gb", 4, 4, 512, Recipe("bf16-master"), Layout(dp=4, zero_stage=3),
        note="LLaMA-2-7B's shape is LLaMA-7B's; FSDP's mixed precision keeps fp32 shards, 16 "
             "bytes per parameter / N as labkit's bf16-master"),
    PublishedRun(
        "torchtune: LLaMA-2-7B LoRA on one GPU",
        "torchtune, recipes/configs/llama2/7B_lora_single_device.yaml: rank-8 LoRA (from "
        "torchtune 0.5 on q, v, the output projection and the MLP; q and v before), bf16, "
        "activation checkpointing, batch 2",
        "llama-2-7b", "rtx-4090-24gb", 1, 2, 2048,
        Recipe("bf16", recompute="full", trainable="lora", lora_rank=8),
        note="the recipe names no GPU: checked on a 24 GB card with every linear adapted and "
             "2048-token sequences, more than it needs"),
    PublishedRun(
        "torchtune: LLaMA-2-70B LoRA with FSDP on 8 GPUs",
        "torchtune, recipes/configs/llama2/70B_lora.yaml (lora_finetune_distributed, FSDP2): "
        "rank-16 LoRA, bf16, activation checkpointing, batch 2 per GPU",
        "llama-2-70b", "a100-80gb", 8, 2, 2048,
        Recipe("bf16", recompute="full", trainable="lora", lora_rank=16),
        Layout(dp=8, zero_stage=3),
        note="its sequences (Alpaca) are under 2048 tokens; 80 GB GPUs assumed"),
    PublishedRun(
        "ms-swift: LLaMA-2-70B QLoRA with FSDP and CPU offload on 2 x 24 GB",
        "ms-swift, examples/pytorch/llm/scripts/llama2_70b_chat/qlora_fsdp/sft.sh (3429fc5): "
        "'2 GPU * 24G', NF4 stored as bf16 so that FSDP shards it (Answer.AI's FSDP-QLoRA, "
        "2024), rank-8 LoRA, bf16, gradient checkpointing, batch 1 of at most 2048 tokens, "
        "accelerate's fsdp_offload config",
        "llama-2-70b", "rtx-4090-24gb", 2, 1, 2048,
        Recipe("bf16", recompute="full", trainable="lora", lora_rank=8, weight_format="nf4"),
        Layout(dp=2, zero_stage=3, offload=True),
        note="its DEFAULT targets are the attention projections: checked with every linear "
             "adapted, more than it needs. labkit's NF4 (not bitsandbytes') decides the margin: "
             "FSDP shards its scales too (bitsandbytes keeps absmax whole on every GPU) and it "
             "dequantises through fp32 (13 bytes per weight at the peak, bitsandbytes' kernel "
             "about 2): kept on the GPUs it needs 25.2 GiB of 21.6, 2.4 GiB less with "
             "bitsandbytes' kernel, still over"),
)

# DeepSeek-V3 technical report (arXiv:2412.19437), section 3.2: 2,048 H800s, pp 16 (DualPipe,
# here 1F1B, which keeps one micro-batch fewer in flight), ep 64 over 8 nodes, ZeRO-1 across the
# data-parallel ranks, no tensor parallelism, FP8; 15,360 sequences of 4096 tokens per step
# (after the ramp): 120 micro-batches of one sequence on each of the 128 data-parallel ranks
DEEPSEEK_V3 = dict(model="deepseek-v3", gpu="h800-80gb", gpus=2048, seq=4096,
                   layout=dict(dp=128, zero_stage=1, pp=16, ep=64, micro_batches=120))


def deepseek_v3_own_layout(recomputes=("none", "selective", "full")) -> list[dict]:
    """DeepSeek-V3's layout estimated in bf16-master (labkit has no FP8) under each recompute
    policy: bytes per GPU of the busiest stage, its parameters, model states and activations,
    against the H800's usable memory."""
    usable = usable_memory(gpu_named(DEEPSEEK_V3["gpu"]))
    rows = []
    for recompute in recomputes:
        est = estimate(DEEPSEEK_V3["model"], 1, DEEPSEEK_V3["seq"],
                       recipe=Recipe("bf16-master", recompute=recompute),
                       layout=Layout(**DEEPSEEK_V3["layout"]), device="cuda")
        rows.append(dict(recompute=recompute, per_gpu=est.total, usable=usable,
                         fits=est.total <= usable, activations=est.activations,
                         states=sum(est.details["model states"].values()),
                         params=est.details["parameters on this device"]))
    return rows


# Unsloth's README ("Context length benchmarks", unslothai/unsloth, December 2024): the longest
# sequence that Hugging Face + FlashAttention-2 trains at batch 1 in QLoRA (NF4, rank-32 LoRA on
# every linear) on a card of each size, taken as GiB; None: out of memory at any length. The 8B's
# column is one straight line in memory (404.7 tokens per GiB on every interval): fitted, not run
# on each card. The 70B ran on an 80 GB A100. Llama 3.1 8B and Llama 3.3 70B have Llama 3's shapes
# with a 128K context (LLAMA_3_CONTEXT).
HF_LONGEST = {"llama-3-8b": {8: None, 12: 932, 16: 2551, 24: 5789, 40: 12264, 48: 15502,
                             80: 28454},
              "llama-3-70b": {48: None, 80: 6916}}
LLAMA_3_CONTEXT = 131072

# Hugging Face's QLoRA as its users run it, in labkit's terms (an assumption: Unsloth's HF script is
# not published): prepare_model_for_kbit_training upcasts every weight that is not NF4 (embeddings,
# head, norms) to fp32 and turns on gradient checkpointing, PEFT keeps the adapters in fp32
# (autocast_adapter_dtype) and the Trainer's bf16=True computes under autocast: bf16-mixed.
HF_QLORA = Recipe("bf16-mixed", recompute="full", trainable="lora", lora_rank=32,
                  weight_format="nf4")


def longest_sequence(model: str | ModelConfig, memory: int, recipe: Recipe,
                     step: int = 16) -> int:
    """The longest sequence (batch 1, to ``step`` tokens) whose estimate fits ``memory`` bytes on
    one GPU, up to the model's ``max_seq``; 0 when ``step`` tokens do not fit."""
    cfg = preset(model) if isinstance(model, str) else model

    def too_long(k: int) -> bool:
        return estimate(cfg, 1, k * step, recipe=recipe, device="cuda").total > memory
    k = first(too_long, 0, cfg.max_seq // step)
    return cfg.max_seq // step * step if k is None else (k - 1) * step


def hf_longest_context(recipe: Recipe = HF_QLORA, fraction: float = 1.0) -> list[dict]:
    """Per card of ``HF_LONGEST``: Hugging Face's longest QLoRA sequence, the estimate's under
    ``recipe`` within ``fraction`` of the card (1: the whole card, where HF ran out; 0.9: the
    planner's usable memory), and the estimate at HF's length (``at_hf``, bytes)."""
    rows = []
    for name, cards in HF_LONGEST.items():
        cfg = preset(name, max_seq=LLAMA_3_CONTEXT)
        for gib, hf in cards.items():
            at_hf = hf and estimate(cfg, 1, hf, recipe=recipe, device="cuda").total
            rows.append(dict(model=name, card=gib * GIB, hf=hf, at_hf=at_hf,
                             labkit=longest_sequence(cfg, int(fraction * gib * GIB), recipe)))
    return rows


def memory_line(rows: list[dict], model: str = "llama-3-8b",
                cards: tuple[int, int] = (48, 80)) -> dict:
    """The straight line memory = fixed + per_token x sequence through two cards (GiB) of
    ``hf_longest_context``'s rows, for Hugging Face ("hf") and the estimate ("labkit")."""
    a, b = (next(r for r in rows if r["model"] == model and r["card"] == gib * GIB)
            for gib in cards)
    line = {}
    for who in ("hf", "labkit"):
        per_token = (b["card"] - a["card"]) / (b[who] - a[who])
        line[who] = dict(per_token=per_token, fixed=a["card"] - a[who] * per_token)
    return line
