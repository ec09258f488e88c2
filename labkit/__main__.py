"""Command line: ``python -m labkit estimate|measure|plan|presets|doctor`` (installed as ``labkit``).

    python -m labkit estimate --model deepseek-v2-lite --seq 4096 --precision bf16-mixed \\
        --zero-stage 2 --dp 8
    python -m labkit measure --model llama-2-7b --seq 2048      # one step on fake tensors
    python -m labkit presets
    python -m labkit plan --model deepseek-v2-lite --gpu a100-80gb --gpus 8 --seq 4096
    python -m labkit doctor                                     # the host, read-only
    python -m labkit doctor --course [--no-smoke]               # does every lab run here?
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from .config import preset, presets
from .checkpointing import RECOMPUTE_POLICIES
from .predict import count_params, estimate
from .recipe import DEVICES, OPTIMIZER_IMPLS, OPTIMIZERS, PRECISIONS, Layout
from .measure import measure_step
from .units import CATEGORIES, fmt_bytes


def _step_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="preset name (see: presets)")
    parser.add_argument("--batch", type=int, default=1, help="micro-batch size per device")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length")
    parser.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS)
    parser.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    parser.add_argument("--optimizer-impl", choices=OPTIMIZER_IMPLS,
                        help="AdamW implementation (default: what torch picks on --device)")
    parser.add_argument("--recompute", default="none", choices=RECOMPUTE_POLICIES,
                        help="activation recomputation policy (every-k uses --every)")
    parser.add_argument("--every", type=int, default=2, help="k of the every-k policy")
    parser.add_argument("--device", default="cuda", choices=DEVICES,
                        help="whose defaults (AdamW foreach on cuda, a for-loop on cpu)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m labkit",
                                     description="GPU memory of LLM training: predict and measure.")
    sub = parser.add_subparsers(dest="command", required=True)
    est = sub.add_parser("estimate", help="closed-form memory of one training step, per device")
    _step_options(est)
    est.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    est.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    est.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    est.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    est.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
    est.add_argument("--micro-batches", type=int, help="pipeline micro-batches (default: pp)")
    est.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"), help="pipeline schedule")
    est.add_argument("--ep", type=int, default=1,
                     help="expert-parallel degree (divides --dp: the experts split over ep of "
                          "the dp ranks)")
    est.add_argument("--cp", type=int, default=1, help="context-parallel degree")
    est.add_argument("--bucket-view", action="store_true",
                     help="DDP's gradient_as_bucket_view (with --zero-stage 0)")
    est.add_argument("--offload", action="store_true",
                     help="ZeRO-Offload: optimizer state and shards in host memory")
    est.add_argument("--explain", action="store_true", help="list the tensors alive at the peak")
    mea = sub.add_parser("measure", help="run one training step under the memory tracker")
    _step_options(mea)
    mea.add_argument("--real", action="store_true",
                     help="real tensors on --device (default: fake tensors, any size)")
    pre = sub.add_parser("presets", help="list the model presets with their sizes")
    pre.add_argument("--json", action="store_true")
    pla = sub.add_parser("plan", help="rank the layouts that fit a cluster by step time")
    pla.add_argument("--model", required=True, help="preset name (see: presets)")
    pla.add_argument("--gpu", required=True, help="GPU type (labkit.gpus.GPUS)")
    pla.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    pla.add_argument("--gpus-per-node", type=int, default=8)
    pla.add_argument("--seq", type=int, default=4096, help="sequence length")
    pla.add_argument("--global-batch", type=int, help="sequences per step (default: one per GPU)")
    pla.add_argument("--trainable", default="all", choices=("all", "lora", "qlora"))
    pla.add_argument("--top", type=int, default=10, help="how many fitting layouts to rank")
    pla.add_argument("--verify", type=int, default=0,
                     help="check the top K on fake tensors where a fake run applies")
    pla.add_argument("--json", action="store_true", help="print JSON instead of a table")
    doc = sub.add_parser("doctor", help="a read-only report of the host: THP, /dev/shm, NUMA, "
                                        "cgroup and memlock limits, allocator settings, GPUs")
    doc.add_argument("--json", action="store_true", help="print JSON instead of a table")
    doc.add_argument("--course", action="store_true",
                     help="before the workshop: does every lab run here (versions, packages, "
                          "memory, disk, cores, GPU, a smoke run of lab 00)? Exit 1 on a problem")
    doc.add_argument("--no-smoke", action="store_true",
                     help="with --course: skip the smoke run (lab 00 executed, about 20 s)")
    return parser


def _table(title: str, result, extra: dict) -> str:
    width = max(len(label) for label in CATEGORIES.values()) + 2
    lines = [title, ""]
    for field, label in CATEGORIES.items():
        lines.append(f"{label:<{width}}{fmt_bytes(getattr(result, field)):>12}")
    lines.append(f"{'total (peak)':<{width}}{fmt_bytes(result.total):>12}")
    lines.append(f"peak during the {result.peak_phase} phase; activations saved at the end of "
                 f"the forward pass: {fmt_bytes(result.saved_activations)}")
    for key, value in extra.items():
        if isinstance(value, dict):
            lines.append(f"{key}:")
            lines += [f"  {k:<{width - 2}}{v:>12}" for k, v in value.items()]
        else:
            lines.append(f"{key}: {value:,}" if isinstance(value, int) else f"{key}: {value}")
    return "\n".join(lines)


def _run(args) -> str:
    if args.command == "doctor":
        from .system import host_report        # changes nothing: commands are printed, never run
        report = host_report()
        return json.dumps(report.as_dict(), indent=2) if args.json else report.text()
    if args.command == "plan":
        from .plan import plan
        result = plan(args.model, args.gpu, args.gpus, args.gpus_per_node, args.seq,
                      args.global_batch, trainable=args.trainable, top=args.top,
                      verify=args.verify, progress=not args.json)
        return json.dumps(result.as_dict(), indent=2, default=str) if args.json else result.text()
    if args.command == "presets":
        rows = {name: count_params(name) for name in presets()}
        if args.json:
            return json.dumps({n: {"total": p.total, "active": p.active,
                                   "published": preset(n).published} for n, p in rows.items()},
                              indent=2)
        lines = [f"{'preset':<18}{'parameters':>18}{'active':>18}  published"]
        lines += [f"{n:<18}{p.total:>18,}{p.active:>18,}  {preset(n).published}"
                  for n, p in rows.items()]
        return "\n".join(lines)
    recompute = f"every-{args.every}" if args.recompute == "every-k" else args.recompute
    step = dict(batch=args.batch, seq=args.seq, precision=args.precision,
                optimizer=args.optimizer, recompute=recompute,
                optimizer_impl=args.optimizer_impl, device=args.device)
    if args.command == "estimate":
        layout = Layout(dp=args.dp, zero_stage=args.zero_stage, tp=args.tp, sp=args.sp,
                        pp=args.pp, micro_batches=args.micro_batches, schedule=args.schedule,
                        ep=args.ep, cp=args.cp, gradient_as_bucket_view=args.bucket_view,
                        offload=args.offload)
        result = estimate(args.model, layout=layout, **step)
        extra = {**result.details,
                 "moments (the peak is the largest)": {k: fmt_bytes(v)
                                                       for k, v in result.moments.items()}}
        if args.json:
            extra["tensors"] = [dataclasses.asdict(t) for t in result.tensors]
        elif args.explain:
            extra["tensors alive at the peak"] = "\n" + result.explain()
        title = (f"{args.model}: predicted bytes per device, {args.device} defaults\n(batch "
                 f"{args.batch}, seq {args.seq}, {args.precision}, {args.optimizer}, "
                 f"ZeRO-{args.zero_stage}{'-Offload' if args.offload else ''}, dp {args.dp}, tp {args.tp}{' with sp' if args.sp else ''}, "
                 f"pp {args.pp}, ep {args.ep}, cp {args.cp})")
    else:
        result = measure_step(args.model, fake=not args.real, **step)
        extra = {"tensors": (f"fake (shapes only), {result.device} defaults" if result.fake
                             else result.device),
                 "optimizer implementation": result.optimizer_impl}
        title = (f"{args.model}: measured bytes at the peak of one training step\n"
                 f"(batch {args.batch}, seq {args.seq}, {args.precision}, {args.optimizer})")
    if args.json:
        return json.dumps({**result.as_dict(), **extra}, indent=2, default=str)
    return _table(title, result, extra)


def _course(args) -> int:
    """doctor --course: one line per check and a verdict (or JSON); 1 when a check fails."""
    from .course_check import SMOKE_BUDGET_S, SMOKE_NOTEBOOK, course_report   # changes nothing
    if not args.no_smoke and not args.json:
        print(f"running {SMOKE_NOTEBOOK.name} at SCALE=\"ci\" as a smoke run (budget "
              f"{SMOKE_BUDGET_S:.0f} s) ...", file=sys.stderr, flush=True)
    report = course_report(smoke=not args.no_smoke)
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.text())
    return 0 if report.ready else 1


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "doctor" and args.no_smoke and not args.course:
        parser.error("--no-smoke goes with --course")
    if args.command == "doctor" and args.course:
        return _course(args)
    try:
        print(_run(args))
    except ValueError as error:       # bad input: the message names the fix
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
