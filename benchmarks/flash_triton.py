"""Time and peak GPU memory of one attention core's forward + backward: labkit's Triton kernels
(FlashAttention-2, ``labkit.transformer.flash_triton``), F.scaled_dot_product_attention and labkit's
TiledAttention (the same algorithm as PyTorch loops).

    python benchmarks/flash_triton.py [--seqs 1024 2048 4096 8192] [--batch 1] [--heads 16]
                                      [--kv-heads 16] [--head-dim 64] [--dtype bf16] [--full]
                                      [--repeats 10] [--block-m 64] [--block-n 32]
                                      [--tiled-block 128]

On a CUDA GPU; causal unless ``--full``. Time: the median of up to ``--repeats`` forward +
backward passes after a warm-up (which compiles the kernels), each between
``torch.cuda.synchronize()`` calls (fewer runs once a size has taken 20 s). Peak:
``torch.cuda.max_memory_allocated()`` during one pass, less what was allocated before it (q, k,
v and the output's gradient). Error: the largest |impl - sdpa| over the output and the three
gradients. Without CUDA it says so and exits 0: the kernels' tests run on a CPU under Triton's
interpreter (``pytest tests/test_flash_triton.py``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from labkit.core.units import fmt_bytes
from labkit.transformer.attention import tiled_attention

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def cores(args) -> dict:
    """impl name -> q, k, v (B, H, T, d) -> (B, H, T, d), causal or not as asked."""
    from labkit.transformer.flash_triton import flash_attention

    causal = not args.full
    return {
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                               enable_gqa=True),
        "triton": lambda q, k, v: flash_attention(q, k, v, causal=causal, block_m=args.block_m,
                                                  block_n=args.block_n),
        "tiled": lambda q, k, v: tiled_attention(q, k, v, causal=causal, block=args.tiled_block),
    }


def inputs(args, seq: int):
    """q (B, H, T, d), k and v (B, Hkv, T, d) leaves and the output's gradient, seeded, on CUDA."""
    g = torch.Generator().manual_seed(0)
    dtype = DTYPES[args.dtype]
    q, k, v, grad_out = (torch.randn(args.batch, h, seq, args.head_dim, generator=g)
                         .to("cuda", dtype)
                         for h in (args.heads, args.kv_heads, args.kv_heads, args.heads))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad_out


def fwd_bwd(core, q, k, v, grad_out):
    """The output and the gradients of q, k and v."""
    out = core(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))


def median_seconds(run, repeats: int, budget_s: float = 20.0) -> float:
    run()                                                                # warm-up (compiles)
    times, spent = [], 0.0
    while len(times) < repeats and (not times or spent < budget_s):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return statistics.median(times)


def peak_bytes(run):
    """Peak bytes ``run`` allocates beyond what was allocated before it, and its result."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--full", action="store_true", help="no causal mask")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--block-m", type=int, default=64, help="Triton: queries per tile")
    parser.add_argument("--block-n", type=int, default=32, help="Triton: keys per tile")
    parser.add_argument("--tiled-block", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/flash_triton.py times Triton kernels on a CUDA GPU; this machine has "
              "none. On a CPU, Triton's interpreter checks the kernels instead: "
              "pytest tests/test_flash_triton.py")
        return
    from labkit.transformer import flash_triton
    if flash_triton.triton is None:
        sys.exit(f"the Triton kernels need triton: {flash_triton.INSTALL}")
    if flash_triton.interpreted():
        sys.exit("TRITON_INTERPRET is set: unset it to time the compiled kernels")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{flash_triton.triton.__version__}; B={args.batch}, H={args.heads}, "
          f"Hkv={args.kv_heads}, d={args.head_dim}, {args.dtype}, "
          f"{'full' if args.full else 'causal'}; triton tiles {args.block_m} x {args.block_n}, "
          f"tiled block {args.tiled_block}; forward + backward, peak beyond q, k, v and dO\n")
    print(f"{'N':>6} {'impl':>6} {'ms':>9} {'peak':>11}  {'time / sdpa':>11} "
          f"{'peak / sdpa':>11} {'max |x - sdpa|':>15}")
    for n in args.seqs:
        q, k, v, grad_out = inputs(args, n)
        rows, reference = {}, None
        for name, core in cores(args).items():
            run = lambda: fwd_bwd(core, q, k, v, grad_out)        # noqa: E731
            seconds = median_seconds(run, args.repeats)
            peak, result = peak_bytes(run)
            if reference is None:                                 # sdpa, the first
                reference = result
            error = max((a.float() - b.float()).abs().max().item()
                        for a, b in zip(result, reference))
            rows[name] = seconds, peak, error
            del result
        sdpa_seconds, sdpa_peak, _ = rows["sdpa"]
        for name, (seconds, peak, error) in rows.items():
            print(f"{n:>6} {name:>6} {seconds * 1000:>9.2f} {fmt_bytes(peak):>11}  "
                  f"{seconds / sdpa_seconds:>10.2f}x {peak / sdpa_peak:>10.2f}x {error:>15.2e}",
                  flush=True)


if __name__ == "__main__":
    main()
