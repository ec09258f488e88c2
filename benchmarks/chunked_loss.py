"""Time and memory of the LM head + cross-entropy: full (tokens, vocab) logits vs chunks.

    python benchmarks/chunked_loss.py [--tokens 4096] [--hidden 512] [--vocab 129280] [--repeats 3]

Prints, on this CPU, the median seconds of forward + backward and the tracker's peak beyond the
inputs (fp32, and bf16 autocast), for the full path and a few chunk sizes, with the ratios to
the full path. The chunked backward recomputes the head's matmul: one more (N, h) x (h, V)
matmul on top of the three a full forward + backward does, so about 4/3 of its FLOPs.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from labkit.core.units import fmt_bytes
from labkit.transformer.loss import chunked_cross_entropy, measure_loss


def median_seconds(tokens, hidden, vocab, chunk, autocast, repeats) -> float:
    h = torch.randn(tokens, hidden, requires_grad=True)                      # (N, h)
    w = (torch.randn(vocab, hidden) * 0.02).requires_grad_()                 # (V, h)
    targets = torch.randint(0, vocab, (tokens,))
    times = []
    for _ in range(repeats + 1):                                             # one warm-up
        start = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            loss = (F.cross_entropy(F.linear(h, w).float(), targets) if chunk is None
                    else chunked_cross_entropy(h, w, targets, chunk))
        loss.backward()
        times.append(time.perf_counter() - start)
        h.grad = w.grad = None
    return statistics.median(times[1:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=129280)
    parser.add_argument("--chunks", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    n, h, v = args.tokens, args.hidden, args.vocab
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; N={n} tokens, h={h}, "
          f"V={v}; median of {args.repeats}; peak = tracker bytes beyond the inputs\n")
    for autocast in (False, True):
        print("bf16 autocast" if autocast else "fp32")
        base = None
        for chunk in [None, *args.chunks]:
            seconds = median_seconds(n, h, v, chunk, autocast, args.repeats)
            peak = measure_loss(n, h, v, chunk, autocast=autocast).backward      # fake: exact bytes
            base = base or (seconds, peak)
            label = "full logits" if chunk is None else f"chunk {chunk}"
            print(f"  {label:12s} {seconds * 1000:8.1f} ms ({seconds / base[0]:.2f}x)   "
                  f"peak {fmt_bytes(peak):>10} ({peak / base[1]:.3f}x)")


if __name__ == "__main__":
    main()
