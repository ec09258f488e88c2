"""Speed of lab 06's mechanisms on this machine: what storing fewer bits costs in time.

    python benchmarks/quantization.py [--repeats 5]

Prints medians of ``--repeats`` runs and the ratios that matter: NF4 quantise and dequantise of
a LLaMA-2-7B MLP weight (4096 x 11008); a training step of ``small`` with LoRA on a bf16 base
against QLoRA on an NF4 base (QLoRA dequantises every weight twice per step); AdamW8bit's step
against torch's AdamW on ``small``; GPTQ against round-to-nearest on one layer.
"""
from __future__ import annotations

import argparse

import torch
from tracker import median_seconds          # benchmarks/tracker.py: the median of repeated calls

import labkit as lk
from labkit.quantisation import gptq, lora, optim8bit, quant
from labkit.training.train import bigram_corpus, compare_with_adamw, make_optimizer, train_step


def lora_step(weight_format, batch=4, seq=64):
    torch.manual_seed(0)
    model = lk.build_model(lk.preset("small")).to(torch.bfloat16)
    lora.apply_lora(model, weight_format=weight_format)
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
    rows = bigram_corpus(model.cfg.vocab_size, batch * (seq + 1)).view(batch, seq + 1)
    return lambda: train_step(model, optimizer, rows[:, :-1], rows[:, 1:], precision="bf16")


def optimizer_step(name):
    torch.manual_seed(0)
    model = lk.build_model(lk.preset("small"))
    optimizer = make_optimizer(model.parameters(), name)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return optimizer.step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    r = args.repeats
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; medians of {r} runs")

    w = torch.randn(11008, 4096) * 0.02                         # LLaMA-2-7B's w_up (out, in)
    q = quant.quantize_nf4(w)
    t_q = median_seconds(lambda: quant.quantize_nf4(w), r)
    t_dq = median_seconds(lambda: quant.dequantize(q), r)
    t_copy = median_seconds(lambda: w.clone(), r)
    print(f"NF4 of a 4096 x 11008 weight: quantise {t_q * 1e3:.0f} ms, dequantise "
          f"{t_dq * 1e3:.0f} ms ({t_dq / t_copy:.1f}x a plain fp32 copy, {t_copy * 1e3:.1f} ms)")

    t_lora, t_qlora = (median_seconds(lora_step(f), r) for f in (None, "nf4"))
    print(f"small, batch 4 x 64, bf16 training step: LoRA {t_lora * 1e3:.0f} ms, QLoRA "
          f"{t_qlora * 1e3:.0f} ms ({t_qlora / t_lora:.2f}x)")

    t_adamw, t_8bit = (median_seconds(optimizer_step(n), r) for n in ("adamw", "adamw-8bit"))
    print(f"small, optimizer step: AdamW {t_adamw * 1e3:.1f} ms, AdamW8bit {t_8bit * 1e3:.1f} ms "
          f"({t_8bit / t_adamw:.1f}x)")

    layer = torch.randn(704, 256) * 0.05
    inputs = torch.randn(1024, 256) @ torch.randn(256, 256) * 0.1   # correlated inputs
    t_rtn = median_seconds(lambda: gptq.rtn_quantize(layer, 4, 64), r)
    t_gptq = median_seconds(lambda: gptq.gptq_quantize(layer, inputs, 4, 64), r)
    print(f"one 704 x 256 layer, int4 g64: RTN {t_rtn * 1e3:.1f} ms, GPTQ {t_gptq * 1e3:.1f} ms "
          f"({t_gptq / t_rtn:.0f}x)")
    cmp = compare_with_adamw(steps=5)
    print(f"(compare_with_adamw: {cmp.seconds_per_step_fp32 * 1e3:.0f} vs "
          f"{cmp.seconds_per_step_8bit * 1e3:.0f} ms per training step of small)")


if __name__ == "__main__":
    main()
