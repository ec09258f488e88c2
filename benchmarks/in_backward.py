"""Speed of the optimizer step inside backward (lab 03) against the ordinary step, on this machine.

    python benchmarks/in_backward.py [--repeats 5]

Prints the median of ``--repeats`` real training steps of ``small`` (fp32, batch 4 x 128): AdamW
for-loop and foreach, each ordinary and in backward (one optimizer per weight, stepped by its
hook), and the ratios. In backward, each weight's update is its own call: a foreach AdamW loses
its one pass over every weight. The memory side is the estimate's (tests/test_in_backward.py).
"""
from __future__ import annotations

import argparse

import torch
from tracker import median_seconds          # benchmarks/tracker.py: the median of repeated calls

import labkit as lk
from labkit.training.measure import init_optimizer_state
from labkit.training.step import make_optimizer, train_step


def step(impl: str, in_backward: bool, batch: int = 4, seq: int = 128):
    """A warmed-up training step of ``small`` to time."""
    torch.manual_seed(0)
    model = lk.build_model(lk.preset("small"))
    params = list(model.parameters())
    optimizer = make_optimizer(params, "adamw", impl, in_backward=in_backward)
    init_optimizer_state(params, optimizer)
    tokens = torch.randint(0, model.cfg.vocab_size, (batch, seq + 1))         # (B, T + 1)
    return lambda: train_step(model, optimizer, tokens[:, :-1], tokens[:, 1:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    r = parser.parse_args().repeats
    print(f"small, fp32, batch 4 x 128, {torch.get_num_threads()} threads; medians of {r} steps")
    for impl in ("for-loop", "foreach"):
        ordinary, inside = (median_seconds(step(impl, flag), r) for flag in (False, True))
        print(f"AdamW {impl:8s}: ordinary {ordinary * 1e3:6.1f} ms, in backward "
              f"{inside * 1e3:6.1f} ms ({inside / ordinary:.2f}x)")


if __name__ == "__main__":
    main()
