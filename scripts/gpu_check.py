"""labkit's GPU path checked on a CUDA machine: one prepared run, a report of numbers.

    python scripts/gpu_check.py [--out DIR] [--budget SECONDS]

1. tracker: real steps measured by ``MemoryTracker`` beside ``torch.cuda.max_memory_allocated``,
   and the same step on fake tensors (CUDA's defaults) and from ``estimate``;
2. allocator: ``memory_snapshot.cuda_check`` - the allocator model's replay beside
   ``max_memory_reserved`` - under several ``PYTORCH_CUDA_ALLOC_CONF`` settings, one process each;
3. triton: ``flash_attention`` against SDPA (errors against an fp32 reference, forward and
   backward), its time beside SDPA's and its memory.

Each check prints its numbers; a failing one prints its error and the run goes on. The report is
also written as JSON (``--out``). Without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import traceback

import torch

import labkit as lk
from labkit.core.config import preset

MIB = 2**20
STARTED = time.perf_counter()

# (label, model, batch, seq, step keywords): one real GPU step each, smallest first
TRACKER_CASES = [
    ("lab 00: small, fp32", ("small", None), 1, 512, dict(precision="fp32")),
    ("7B-wide x 4 layers, fp32", ("llama-2-7b", 4), 1, 2048, dict(precision="fp32")),
    ("7B-wide x 4 layers, bf16-mixed", ("llama-2-7b", 4), 1, 2048, dict(precision="bf16-mixed")),
    ("7B-wide x 4 layers, fp16-mixed", ("llama-2-7b", 4), 1, 2048, dict(precision="fp16-mixed")),
    ("7B-wide x 4 layers, bf16", ("llama-2-7b", 4), 1, 2048, dict(precision="bf16")),
    ("7B-wide x 4 layers, bf16-master", ("llama-2-7b", 4), 1, 2048, dict(precision="bf16-master")),
    ("7B-wide x 4 layers, bf16-mixed, full recompute", ("llama-2-7b", 4), 2, 2048,
     dict(recompute="full")),
    ("7B-wide x 4 layers, bf16-mixed, selective", ("llama-2-7b", 4), 2, 2048,
     dict(recompute="selective")),
    ("7B-wide x 4 layers, bf16-mixed, adamw-8bit", ("llama-2-7b", 4), 1, 2048,
     dict(optimizer="adamw-8bit")),
    ("7B-wide x 4 layers, bf16-mixed, chunked loss", ("llama-2-7b", 4), 1, 4096,
     dict(loss_chunk=1024)),
    ("V2-Lite x 4 layers, bf16-mixed (MoE, MLA)", ("deepseek-v2-lite", 4), 1, 2048, dict()),
    ("LLaMA-2-7B LoRA r16, full recompute", ("llama-2-7b", None), 1, 2048,
     dict(trainable="lora", recompute="full")),
    ("LLaMA-2-7B LoRA r16 on bf16 weights, full", ("llama-2-7b", None), 1, 2048,
     dict(precision="bf16", trainable="lora", recompute="full")),
    ("LLaMA-2-7B QLoRA r16, full recompute", ("llama-2-7b", None), 1, 2048,
     dict(trainable="lora", weight_format="nf4", recompute="full")),
    ("LLaMA-2-7B bf16-mixed", ("llama-2-7b", None), 1, 1024, dict()),
]

ALLOC_CASES = [  # (PYTORCH_CUDA_ALLOC_CONF, model, batch, seq, step keywords)
    ("", ("llama-2-7b", 4), 1, 2048, dict()),
    ("expandable_segments:True", ("llama-2-7b", 4), 1, 2048, dict()),
    ("", ("llama-2-7b", 4), 1, 2048, dict(then=[(2, 1024), (1, 3072), (4, 512)])),
    ("expandable_segments:True", ("llama-2-7b", 4), 1, 2048,
     dict(then=[(2, 1024), (1, 3072), (4, 512)])),
    ("max_split_size_mb:128", ("llama-2-7b", 4), 1, 2048,
     dict(then=[(2, 1024), (1, 3072), (4, 512)])),
    ("", ("small", None), 8, 1024, dict(precision="fp32")),
]


def model(spec):
    name, layers = spec
    return preset(name) if layers is None else preset(name, layers=layers)


def pct(a: int, b: int) -> str:
    return f"{100 * (a / b - 1):+.2f}%"


def elapsed() -> float:
    return time.perf_counter() - STARTED


def fresh():
    gc.collect()
    torch.cuda.empty_cache()


# ---- 1. the tracker ------------------------------------------------------------------------
def tracker_case(label, spec, batch, seq, step) -> dict:
    cfg = model(spec)
    predicted = lk.estimate(cfg, batch, seq, device="cuda", **step)
    free, total = torch.cuda.mem_get_info()
    if predicted.total > 0.95 * free:
        return dict(label=label, skipped=f"estimate {lk.fmt_bytes(predicted.total)} > 95% of "
                                         f"the {lk.fmt_bytes(free)} free")
    start = time.perf_counter()
    real = lk.measure_step(cfg, batch, seq, fake=False, device="cuda", **step)
    real_s = time.perf_counter() - start
    fresh()
    fake = lk.measure_step(cfg, batch, seq, fake=True, device="cuda", **step)
    return dict(label=label, batch=batch, seq=seq, tracker=real.total, cuda=real.cuda_peak,
                fake=fake.total, estimate=predicted.total, real_seconds=real_s,
                peak_phase=real.peak_phase, impl=real.optimizer_impl,
                real_by_category=real.as_dict(), fake_by_category=fake.as_dict(),
                estimate_by_category=predicted.as_dict())


def check_tracker(budget: float) -> list[dict]:
    print("\n== 1. tracker vs torch.cuda.max_memory_allocated (real steps), fake step, estimate")
    print(f"{'case':48s} {'tracker':>10s} {'cuda peak':>10s} {'cuda-trk':>9s} "
          f"{'fake':>10s} {'fake/trk':>8s} {'estimate':>10s} {'est/trk':>8s}")
    rows = []
    for label, spec, batch, seq, step in TRACKER_CASES:
        if elapsed() > budget:
            print(f"{label:48s} not run: past the {budget:.0f} s budget")
            continue
        try:
            row = tracker_case(label, spec, batch, seq, step)
        except Exception as error:                 # noqa: BLE001 - report and go on
            row = dict(label=label, error=f"{type(error).__name__}: {error}",
                       trace=traceback.format_exc(limit=4))
        fresh()
        rows.append(row)
        if "skipped" in row or "error" in row:
            print(f"{label:48s} {row.get('skipped') or row['error'][:300]}")
            continue
        print(f"{label:48s} {lk.fmt_bytes(row['tracker']):>10s} {lk.fmt_bytes(row['cuda']):>10s} "
              f"{(row['cuda'] - row['tracker']) / MIB:8.1f}M {lk.fmt_bytes(row['fake']):>10s} "
              f"{pct(row['fake'], row['tracker']):>8s} {lk.fmt_bytes(row['estimate']):>10s} "
              f"{pct(row['estimate'], row['tracker']):>8s}  ({row['real_seconds']:.1f} s, "
              f"{row['impl']}, peak in {row['peak_phase']})")
    return rows


# ---- 1b. a server's profiling run -----------------------------------------------------------
def check_serving(budget: float) -> list[dict]:
    """labkit.training.serving's profile on real CUDA tensors: the tracker vs torch's peak."""
    from labkit.training.serving import profile_forward
    print("\n== 1b. a server's profiling run: tracker vs torch.cuda.max_memory_allocated")
    rows = []
    for tokens in (2048, 8192):
        if elapsed() > budget:
            break
        cfg = model(("llama-2-7b", 4))
        fresh()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        tracked = profile_forward(cfg, tokens, 256, fake=False, device="cuda")
        cuda = torch.cuda.max_memory_allocated() - base
        fake = profile_forward(cfg, tokens, 256)
        rows.append(dict(tokens=tokens, tracker=tracked.weights + tracked.activations, cuda=cuda,
                         fake=fake.weights + fake.activations))
        print(f"{tokens:6d} tokens: tracker {lk.fmt_bytes(rows[-1]['tracker'])}, cuda peak "
              f"{lk.fmt_bytes(cuda)} ({pct(cuda, rows[-1]['tracker'])}), fake "
              f"{lk.fmt_bytes(rows[-1]['fake'])}")
    return rows


# ---- 2. the allocator model ----------------------------------------------------------------
def alloc_one(index: int) -> dict:
    """One ALLOC_CASES entry in this process (its settings must be set before CUDA starts)."""
    from labkit.host.memory_snapshot import cuda_check
    conf, spec, batch, seq, step = ALLOC_CASES[index]
    chk = cuda_check(model(spec), batch, seq, **step)
    return dict(conf=conf, spec=list(spec), batch=batch, seq=seq, then=step.get("then", []),
                tracker=chk.tracker_peak, cuda_allocated=chk.cuda_allocated,
                model_allocated=chk.model.peak_allocated, cuda_reserved=chk.cuda_reserved,
                model_reserved=chk.model.peak_reserved, error=chk.reserved_error,
                segments_real=len(chk.real_snapshot["segments"]),
                segments_model=len(chk.model_snapshot["segments"]))


def check_allocator(budget: float) -> list[dict]:
    print("\n== 2. allocator model vs torch.cuda.max_memory_reserved (cuda_check, one process each)")
    print(f"{'PYTORCH_CUDA_ALLOC_CONF':26s} {'case':26s} {'alloc GPU':>10s} {'model':>10s} "
          f"{'resv GPU':>10s} {'model':>10s} {'error':>8s} {'segs':>9s}")
    rows = []
    for i, (conf, spec, batch, seq, step) in enumerate(ALLOC_CASES):
        case = f"{spec[0]}x{spec[1] or 'all'} b{batch} s{seq}" + (" +shapes" if "then" in step else "")
        if elapsed() > budget:
            print(f"{conf or '(default)':26s} {case:26s} not run: past the {budget:.0f} s budget")
            continue
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        done = subprocess.run([sys.executable, __file__, "--alloc-one", str(i)], env=env,
                              capture_output=True, text=True, timeout=240)
        try:
            row = json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            row = dict(conf=conf, error_text=(done.stderr or done.stdout)[-1500:])
            print(f"{conf or '(default)':26s} {case:26s} failed:\n{row['error_text']}")
            rows.append(row)
            continue
        rows.append(row)
        print(f"{conf or '(default)':26s} {case:26s} {lk.fmt_bytes(row['cuda_allocated']):>10s} "
              f"{lk.fmt_bytes(row['model_allocated']):>10s} {lk.fmt_bytes(row['cuda_reserved']):>10s} "
              f"{lk.fmt_bytes(row['model_reserved']):>10s} {100 * row['error']:+7.2f}% "
              f"{row['segments_real']:4d}/{row['segments_model']:<4d}")
    return rows


# ---- 3. the Triton kernel ------------------------------------------------------------------
ATTENTION_SHAPES = [  # B, H, Hkv, T_q, T_k, d, causal
    (2, 8, 8, 1024, 1024, 64, True),
    (1, 16, 16, 2048, 2048, 128, True),
    (2, 16, 4, 1024, 1024, 128, True),
    (2, 8, 2, 500, 700, 64, False),
    (1, 8, 8, 333, 333, 32, True),
    (1, 4, 4, 300, 900, 16, True),
]


def _grads(fn, q, k, v, grad):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


def check_triton(budget: float) -> dict:
    import torch.nn.functional as F
    import triton
    from labkit.transformer.flash_triton import flash_attention

    print(f"\n== 3. flash_attention (Triton {triton.__version__}) vs SDPA")
    result = {"errors": [], "timing": [], "tiles": []}
    print(f"{'B,H,Hkv,Tq,Tk,d,causal':30s} {'dtype':5s} {'max |err| ours: out dq dk dv':40s} "
          f"{'SDPA same dtype: out dq dk dv':40s}")
    for shape in ATTENTION_SHAPES:
        B, H, Hkv, Tq, Tk, d, causal = shape
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            if elapsed() > budget:
                break
            try:
                torch.manual_seed(0)
                q = torch.randn(B, H, Tq, d, device="cuda", dtype=dtype)
                k = torch.randn(B, Hkv, Tk, d, device="cuda", dtype=dtype)
                v = torch.randn(B, Hkv, Tk, d, device="cuda", dtype=dtype)
                grad = torch.randn(B, H, Tq, d, device="cuda", dtype=dtype)
                sdpa = lambda q, k, v: F.scaled_dot_product_attention(  # noqa: E731
                    q, k, v, is_causal=causal, enable_gqa=True)
                ref = _grads(sdpa, *(t.double() for t in (q, k, v, grad)))
                ours = _grads(lambda q, k, v: flash_attention(q, k, v, causal=causal), q, k, v, grad)
                theirs = _grads(sdpa, q, k, v, grad)
                e_ours = [(a.double() - r).abs().max().item() for a, r in zip(ours, ref)]
                e_sdpa = [(a.double() - r).abs().max().item() for a, r in zip(theirs, ref)]
                result["errors"].append(dict(shape=shape, dtype=str(dtype), ours=e_ours, sdpa=e_sdpa))
                print(f"{str(shape):30s} {str(dtype)[6:]:5s} {' '.join(f'{e:9.2e}' for e in e_ours):40s} "
                      f"{' '.join(f'{e:9.2e}' for e in e_sdpa):40s}")
            except Exception as error:             # noqa: BLE001
                result["errors"].append(dict(shape=shape, dtype=str(dtype), error=repr(error)))
                print(f"{str(shape):30s} {str(dtype)[6:]:5s} FAILED {type(error).__name__}: {error}"[:400])
    print("\nforward + backward, bf16, causal, B=4 H=16 T=4096: median ms (triton.testing.do_bench) "
          "and peak bytes beyond the inputs")
    for d in (64, 128):
        for name, fn in (("flash_attention (labkit, Triton)",
                          lambda q, k, v: flash_attention(q, k, v, causal=True)),
                         ("SDPA (default backend)",
                          lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))):
            if elapsed() > budget:
                break
            try:
                q, k, v, grad = (torch.randn(4, 16, 4096, d, device="cuda", dtype=torch.bfloat16)
                                 for _ in range(4))
                for t in (q, k, v):
                    t.requires_grad_()
                fwd = triton.testing.do_bench(lambda: fn(q, k, v))
                both = triton.testing.do_bench(lambda: fn(q, k, v).backward(grad),
                                               grad_to_none=[q, k, v])
                q.grad = k.grad = v.grad = None
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                fn(q, k, v).backward(grad)
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
                flops = 4 * 4 * 16 * 4096 * 4096 * d / 2        # causal: half of QK^T and PV
                row = dict(d=d, impl=name, fwd_ms=fwd, fwd_bwd_ms=both, peak=peak,
                           fwd_tflops=flops / fwd / 1e9, fwd_bwd_tflops=3.5 * flops / both / 1e9)
                result["timing"].append(row)
                print(f"d={d:3d} {name:34s} fwd {fwd:7.3f} ms ({row['fwd_tflops']:5.1f} TFLOP/s)  "
                      f"fwd+bwd {both:7.3f} ms  peak {lk.fmt_bytes(peak)}")
                del q, k, v, grad
                fresh()
            except Exception as error:             # noqa: BLE001
                print(f"d={d:3d} {name:34s} FAILED {type(error).__name__}: {error}"[:400])
    print("\ntile sizes, forward, bf16, causal, B=4 H=16 T=4096 d=128: median ms")
    q, k, v = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for bm, bn in ((64, 32), (64, 64), (128, 32), (128, 64), (128, 128)):
        if elapsed() > budget:
            break
        try:
            ms = triton.testing.do_bench(lambda: flash_attention(q, k, v, True, bm, bn))
            result["tiles"].append(dict(block_m=bm, block_n=bn, ms=ms))
            print(f"block_m {bm:3d} block_n {bn:3d}: {ms:7.3f} ms")
        except Exception as error:                 # noqa: BLE001
            print(f"block_m {bm:3d} block_n {bn:3d}: FAILED {type(error).__name__}: {str(error)[:200]}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for gpu_check.json")
    parser.add_argument("--budget", type=float, default=420, help="seconds; later checks skip past it")
    parser.add_argument("--alloc-one", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.alloc_one is not None:
        print(json.dumps(alloc_one(args.alloc_one)))
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (run this on a GPU machine)")
        return 0
    props = torch.cuda.get_device_properties(0)
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {props.name}, "
          f"{lk.fmt_bytes(props.total_memory)}, labkit from {os.path.dirname(lk.__file__)}")
    report = {"torch": torch.__version__, "gpu": props.name}
    for name, check, share in (("tracker", check_tracker, 0.55), ("serving", check_serving, 0.6),
                               ("allocator", check_allocator, 0.8),
                               ("triton", check_triton, 1.0)):
        try:
            report[name] = check(share * args.budget)
        except Exception:                          # noqa: BLE001
            report[name] = {"error": traceback.format_exc()}
            print(report[name]["error"])
        print(f"[{elapsed():.0f} s]")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
