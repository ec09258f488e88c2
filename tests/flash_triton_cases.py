"""What tests/test_flash_triton.py runs with labkit's Triton kernels: on a GPU in the test's own
process, on a CPU here in a process of its own under Triton's interpreter. TRITON_INTERPRET=1
must be set before triton is first imported, and importing labkit imports it (through
torch.utils.flop_counter), so the pytest process cannot switch to the interpreter itself.

    TRITON_INTERPRET=1 python tests/flash_triton_cases.py CASE ...   # prints {case: result} as JSON
"""
import json
import sys

import torch
import torch.nn.functional as F

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (B, H, Hkv, T_q, T_k, d, block_m, block_n): tiny, the interpreter takes 0.1-0.4 s for each
SHAPES = {"T not a multiple of the blocks, batch 2": (2, 2, 2, 20, 20, 16, 16, 16),
          "grouped kv heads, more queries than keys": (1, 4, 2, 20, 12, 32, 16, 16),
          "one kv head, more keys than queries": (1, 2, 1, 20, 45, 16, 32, 16),
          "default blocks, d 64, grouped, batch 2": (2, 4, 2, 100, 100, 64, 64, 32)}   # slow


def case_name(shape: str, dtype: str, causal: bool) -> str:
    return f"{shape}, {dtype}, {'causal' if causal else 'full'}"


def qkv(B, H, Hkv, T_q, T_k, d, dtype=torch.float32, device="cpu", seed=0):
    """q, k, v (B, heads, T, d) as a model makes them: views of (B, T, heads, d) projections;
    and the output's gradient."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, grad_out = (torch.randn(B, T, h, d, generator=g).to(device, dtype).transpose(1, 2)
                         for h, T in ((H, T_q), (Hkv, T_k), (Hkv, T_k), (H, T_q)))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad_out


def _output_and_grads(fn, q, k, v, grad_out):
    y = fn(q, k, v)
    return (y, *torch.autograd.grad(y, (q, k, v), grad_out))


def errors_to_sdpa(shape: str, dtype: str, causal: bool, device: str) -> dict:
    """Max |flash_attention - SDPA| of the output and the gradients of q, k and v."""
    from labkit.transformer.flash_triton import flash_attention

    B, H, Hkv, T_q, T_k, d, block_m, block_n = SHAPES[shape]
    q, k, v, grad_out = qkv(B, H, Hkv, T_q, T_k, d, DTYPES[dtype], device)
    sdpa = _output_and_grads(lambda *t: F.scaled_dot_product_attention(
        *t, is_causal=causal, enable_gqa=True), q, k, v, grad_out)
    flash = _output_and_grads(lambda *t: flash_attention(
        *t, causal=causal, block_m=block_m, block_n=block_n), q, k, v, grad_out)
    assert all(a.dtype == b.dtype and a.shape == b.shape for a, b in zip(sdpa, flash))
    return {name: (b.double() - a.double()).abs().max().item()
            for name, a, b in zip(("output", "dq", "dk", "dv"), sdpa, flash)}


def kept_for_backward(device: str) -> dict:
    """What the forward pass saves besides q, k, v and the output, and the output's layout."""
    from labkit.transformer.flash_triton import flash_attention

    q, k, v, _ = qkv(1, 2, 1, 20, 20, 16, device=device)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = flash_attention(q, k, v, block_m=16, block_n=16)
    ours = {t.data_ptr() for t in (q, k, v, out)}
    return {"inputs and output saved": ours <= {t.data_ptr() for t in saved},
            "others": [[list(t.shape), str(t.dtype)] for t in saved if t.data_ptr() not in ours],
            "output as (B, T, H, d)": out.transpose(1, 2).is_contiguous()}


def run(case: str, device: str = "cpu"):
    if case == "kept for backward":
        return kept_for_backward(device)
    *shape, dtype, causal = case.split(", ")
    return errors_to_sdpa(", ".join(shape), dtype, causal == "causal", device)


if __name__ == "__main__":
    torch.set_num_threads(1)          # tiny tensors: a second thread only waits
    results = {}
    for case in sys.argv[1:]:
        try:
            results[case] = run(case)
        except Exception as e:        # the test shows it beside its case
            results[case] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(results))
