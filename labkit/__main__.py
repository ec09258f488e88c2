"""Command line: ``python -m labkit estimate|measure|plan|serve|presets|doctor`` (installed as ``labkit``).

    python -m labkit estimate --model deepseek-v2-lite --seq 4096 --precision bf16-mixed \\
        --zero-stage 2 --dp 8
    python -m labkit estimate --model path/to/config.json      # a Hugging Face model's config
    python -m labkit measure --model llama-2-7b --seq 2048      # one step on fake tensors
    python -m labkit measure --model tiny --real                # real tensors: the GPU, else the CPU
    python -m labkit presets
    python -m labkit plan --model deepseek-v2-lite --gpu a100-80gb --gpus 8 --seq 4096
    python -m labkit serve --model llama-2-70b --gpu h100-80gb --tp 4   # a server's KV pool
    python -m labkit doctor                                     # the host, read-only
    python -m labkit doctor --course [--no-smoke]               # does every lab run here?

Every choice list is labkit's own vocabulary. Bad input exits with code 2 and one line that
names the fix; a reader that leaves early (``| head``) ends the output quietly.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from pathlib import Path

from labkit import __version__
from labkit.core.config import ModelConfig, preset, presets
from labkit.core.gpus import GPUS, HEADROOM, JSON_EXAMPLE, gpu, usable_memory
from labkit.core.hf import from_hf_config
from labkit.core.recipe import (ATTENTION_IMPLS, DEVICES, OPTIMIZER_IMPLS, OPTIMIZERS,
                                PARAM_DTYPES, PRECISIONS, SCHEDULES, Layout, fine_tuning_fields)
from labkit.core.recompute import RECOMPUTE_POLICIES
from labkit.core.units import CATEGORIES, fmt_bytes
from labkit.course.plan import OPTIMIZERS as PLANNED_OPTIMIZERS, RECOMPUTE, TRAINABLE, plan
from labkit.parallel.data.zero import SHARDED_FROM_STAGE
from labkit.predict import count_params, estimate

PROG = "python -m labkit"
ZERO_STAGES = tuple(range(max(SHARDED_FROM_STAGE.values()) + 1))   # 0 (DDP) up to 3 (params)
INTERLEAVED_CHUNKS = 2          # model chunks per stage when --schedule interleaved gives none
MOMENTS = "moments (the peak is the largest)"
EXIT_SIGPIPE = 128 + 13         # what a shell reports for a Unix tool whose reader left


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one line naming the fix (no usage block), exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def _at_least(low: int):
    """An argparse type: an integer of at least ``low`` (argparse names the option if not)."""
    def number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            wanted = "a positive integer" if low == 1 else f"an integer of at least {low}"
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
        return value
    return number


COUNT, COUNT_OR_ZERO = _at_least(1), _at_least(0)


def _gpu(text: str):
    """--gpu: a GPU type's name, or one's own as JSON (a .json file, or the text itself)."""
    try:
        return gpu(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _float(text: str) -> float:
    """The number ``text`` says, or -1.0 when it says none (out of every range asked)."""
    try:
        return float(text)
    except ValueError:
        return -1.0


def _gbps(text: str) -> float:
    """--host-gbps: a positive finite number of GB/s."""
    value = _float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"give GB/s as a positive number (e.g. 409.6), not "
                                         f"{text!r}")
    return value


def _gib(text: str) -> float:
    """--other-gib: zero or more GiB."""
    value = _float(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"give GiB as a number >= 0 (e.g. 1.5), not {text!r}")
    return value


def _fraction(text: str) -> float:
    """--headroom: a fraction in [0, 1)."""
    value = _float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a fraction of the GPU's memory in [0, 1) "
                                         f"such as 0.1, got {text!r}")
    return value


GPU_HELP = (f"GPU type ({', '.join(GPUS)}), or your own as JSON: a .json file or the text, "
            f"e.g. '{JSON_EXAMPLE}'")


def _cached_config(name: str) -> Path | None:
    """config.json of a Hub model (``org/name``) in the local Hugging Face cache, or None.
    Nothing is downloaded."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:                     # the [hf] extra is not installed
        return None
    found = try_to_load_from_cache(name, "config.json")
    return Path(found) if isinstance(found, str) else None


def _model(text: str) -> ModelConfig:
    """--model: a preset name, a Hugging Face config.json (or the folder that holds one), or
    the name of a Hub model whose config.json is in the local Hugging Face cache."""
    path = Path(text)
    file = path / "config.json" if path.is_dir() else path
    names_a_file = file.suffix == ".json" or path.exists()
    try:
        if text not in presets() and not names_a_file and "/" in text:
            file = _cached_config(text)
            if file is None:
                raise ValueError(f"{text!r} is not a preset, a config.json or a model in the "
                                 f"local Hugging Face cache; fetch its config with "
                                 f"`huggingface-cli download {text} config.json` (or pass the "
                                 f"file's path)")
            names_a_file = True
        if text in presets() or not names_a_file:
            return preset(text)                 # a ValueError lists the presets
        return from_hf_config(json.loads(file.read_text()))
    except FileNotFoundError:
        message = (f"no such file: {file}; give the path of a Hugging Face config.json, or a "
                   f"preset name ({PROG} presets lists them)")
    except KeyError as key:
        message = f"{file} has no {key}: is it a Hugging Face config.json?"
    except ValueError as error:            # an unknown preset, unsupported model, bad JSON
        message = str(error)
    raise argparse.ArgumentTypeError(message)


def _model_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, type=_model,
                        help="preset name (see: presets), a Hugging Face config.json or its "
                             "folder, or a Hub model name (org/name) in the local HF cache")


def _json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _step_options(parser: argparse.ArgumentParser) -> None:
    _model_option(parser)
    parser.add_argument("--batch", type=COUNT, default=1, help="micro-batch size per device")
    parser.add_argument("--seq", type=COUNT, default=2048, help="sequence length")
    parser.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS)
    parser.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    parser.add_argument("--optimizer-impl", choices=OPTIMIZER_IMPLS,
                        help="AdamW implementation (default: what torch picks on --device)")
    parser.add_argument("--recompute", default="none", choices=RECOMPUTE_POLICIES,
                        help="activation recomputation policy (every-k uses --every)")
    parser.add_argument("--every", type=COUNT, default=2, help="k of the every-k policy")
    parser.add_argument("--trainable", default="all", choices=TRAINABLE,
                        help="every parameter, LoRA adapters on the frozen model, or QLoRA "
                             "(adapters on NF4 weights)")
    parser.add_argument("--lora-rank", type=COUNT, default=16, help="rank of the LoRA adapters")
    parser.add_argument("--attention", default="sdpa", choices=ATTENTION_IMPLS,
                        help="attention core: sdpa (fused, no T x T kept; soft-capped models run "
                             "labkit's tiled core, as FlashAttention-2), naive (the T x T "
                             "matrices kept, as transformers' eager attention), tiled")
    parser.add_argument("--optimizer-in-backward", action="store_true",
                        help="step each weight as its gradient is made, then free the gradient "
                             "(one device, one micro-batch)")
    _json_option(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="GPU memory of LLM training: predict and measure.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    est = sub.add_parser("estimate", help="closed-form memory of one training step, per device")
    _step_options(est)
    est.add_argument("--device", default="cuda", choices=DEVICES,
                     help="whose defaults (AdamW foreach on cuda, a for-loop on cpu)")
    _layout_options(est)
    est.add_argument("--explain", action="store_true", help="list the tensors alive at the peak")
    est.add_argument("--gpu", type=_gpu, metavar="GPU",
                     help=f"say whether the step fits this GPU with the planner's "
                          f"{HEADROOM:.0%}% headroom: {GPU_HELP}")   # %%: argparse's
    mea = sub.add_parser("measure", help="run one training step under the memory tracker")
    _step_options(mea)
    mea.add_argument("--device", choices=DEVICES,
                     help="whose defaults (default: cuda's); with --real also where the step "
                          "runs (default: cuda when present, else cpu)")
    mea.add_argument("--real", action="store_true",
                     help="real tensors (default: fake tensors, any size)")
    pre = sub.add_parser("presets", help="list the model presets with their sizes")
    _json_option(pre)
    pla = sub.add_parser("plan", help="rank the layouts that fit a cluster by step time")
    _model_option(pla)
    _plan_options(pla)
    _json_option(pla)
    ser = sub.add_parser("serve", help="the KV-cache pool a vLLM-style server sizes after its "
                                       "profiling run, per GPU")
    _model_option(ser)
    _serve_options(ser)
    _json_option(ser)
    doc = sub.add_parser("doctor", help="a read-only report of the host: THP, /dev/shm, NUMA, "
                                        "cgroup and memlock limits, allocator settings, GPUs")
    _json_option(doc)
    doc.add_argument("--course", action="store_true",
                     help="before the workshop: does every lab run here (versions, packages, "
                          "memory, disk, cores, GPU, a smoke run of lab 00)? Exit 1 on a problem")
    doc.add_argument("--no-smoke", action="store_true",
                     help="with --course: skip the smoke run (lab 00 executed, about 20 s)")
    return parser


def _serve_options(ser: argparse.ArgumentParser) -> None:
    """serve's options, named as vLLM's engine arguments."""
    ser.add_argument("--gpu", type=_gpu, required=True, metavar="GPU", help=GPU_HELP)
    ser.add_argument("--tp", type=COUNT, default=1, help="tensor-parallel GPUs")
    ser.add_argument("--gpu-memory-utilization", type=_float, default=0.9,
                     help="the server's share of each GPU, for weights, activations and cache")
    ser.add_argument("--max-num-batched-tokens", type=COUNT, default=8192,
                     help="tokens of the largest step: the profiling run's")
    ser.add_argument("--max-num-seqs", type=COUNT, default=256, help="requests in a step")
    ser.add_argument("--block-size", type=COUNT, default=16, help="tokens per block")
    ser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"), help="the weights'")
    ser.add_argument("--kv-dtype", choices=("bf16", "fp16", "fp8-e4m3", "fp8-e5m2"),
                     help="the cache's (default: the weights'); vLLM's fp8 is fp8-e4m3")
    ser.add_argument("--max-model-len", type=COUNT, help="tokens per request, for concurrency "
                                                          "(default: the model's max_seq)")
    ser.add_argument("--other-gib", type=_gib, default=0.0, help="GiB outside the profile to "
                     "take from the share: CUDA graphs, NCCL, workspaces (default 0)")


def _layout_options(est: argparse.ArgumentParser) -> None:
    """estimate's layout: ZeRO, dp, tp, sp, pp and its schedule, ep, etp, cp, HSDP, offload."""
    est.add_argument("--zero-stage", type=int, default=0, choices=ZERO_STAGES)
    est.add_argument("--dp", type=COUNT, default=1, help="data-parallel degree")
    est.add_argument("--tp", type=COUNT, default=1, help="tensor-parallel degree")
    est.add_argument("--pp", type=COUNT, default=1, help="pipeline-parallel degree")
    est.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
    est.add_argument("--micro-batches", type=COUNT, help="pipeline micro-batches (default: pp)")
    est.add_argument("--schedule", default=Layout.schedule, choices=SCHEDULES, help="pipeline")
    est.add_argument("--virtual-stages", type=COUNT,
                     help=f"model chunks per pipeline stage (interleaved only; default "
                          f"{INTERLEAVED_CHUNKS} there)")
    est.add_argument("--ep", type=COUNT, default=1, help="expert-parallel degree (divides --dp)")
    est.add_argument("--etp", type=COUNT, default=1, help="each expert split over etp ranks")
    est.add_argument("--param-dtype", choices=PARAM_DTYPES, help="ZeRO-3 as FSDP2's policy")
    est.add_argument("--cp", type=COUNT, default=1, help="context-parallel degree")
    est.add_argument("--replicas", type=COUNT, default=1,
                     help="HSDP: ZeRO inside dp x cp / replicas ranks, replicated across")
    est.add_argument("--bucket-view", action="store_true", help="DDP's gradient_as_bucket_view")
    est.add_argument("--offload", action="store_true",
                     help="ZeRO-Offload: optimizer state and shards in host memory")


def _plan_options(pla: argparse.ArgumentParser) -> None:
    """plan's cluster (GPU type and count, host memory) and question (sequence, batch, what trains)."""
    pla.add_argument("--gpu", required=True, type=_gpu, help=GPU_HELP)
    pla.add_argument("--gpus", type=COUNT, required=True, help="number of GPUs")
    pla.add_argument("--gpus-per-node", type=COUNT, default=8)
    pla.add_argument("--seq", type=COUNT, default=4096, help="sequence length")
    pla.add_argument("--global-batch", type=COUNT,
                     help="sequences per step (default: one per GPU)")
    pla.add_argument("--trainable", nargs="+", default=["all"], choices=TRAINABLE,
                     help="what trains, one or several: full fine-tuning (all), lora, qlora")
    pla.add_argument("--recompute", nargs="+", default=list(RECOMPUTE), choices=RECOMPUTE,
                     help="recompute policies to search (default: all three)")
    pla.add_argument("--optimizer", nargs="+", default=["adamw"], choices=PLANNED_OPTIMIZERS,
                     help="full fine-tuning's optimizers to search (default: adamw; adamw-8bit "
                          "changes the training's numbers, so it is searched only when asked)")
    pla.add_argument("--headroom", type=_fraction, default=HEADROOM,
                     help=f"fraction of each GPU's memory kept free for the CUDA context, NCCL "
                          f"buffers and fragmentation (default {HEADROOM})")
    pla.add_argument("--host-ram", type=COUNT, metavar="GIB",
                     help="host memory per node in GiB, for ZeRO-Offload (default: the GPU "
                          "type's per-GPU share times the GPUs on a node, e.g. 2048 for 8 H100s)")
    pla.add_argument("--host-gbps", type=_gbps, metavar="GB/S",
                     help="host memory bandwidth per node in GB/s, for ZeRO-Offload's CPU step "
                          "(default: the GPU type's per-GPU share times the GPUs on a node)")
    pla.add_argument("--top", type=COUNT, default=10, help="how many fitting layouts to rank")
    pla.add_argument("--verify", type=COUNT_OR_ZERO, default=0,
                     help="check the top K on fake tensors where a fake run applies")


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
        from labkit.host.system import host_report  # changes nothing: prints commands, runs none
        report = host_report()
        return json.dumps(report.as_dict(), indent=2) if args.json else report.text()
    if args.command == "plan":
        result = plan(args.model, args.gpu, args.gpus, args.gpus_per_node, args.seq,
                      args.global_batch, headroom=args.headroom,
                      trainable=tuple(dict.fromkeys(args.trainable)),
                      recompute=tuple(dict.fromkeys(args.recompute)), top=args.top,
                      optimizer=tuple(dict.fromkeys(args.optimizer)),
                      verify=args.verify, progress=not args.json,
                      host_ram=args.host_ram and args.host_ram * 2**30,
                      host_gbps=args.host_gbps)
        return json.dumps(result.as_dict(), indent=2, default=str) if args.json else result.text()
    if args.command == "presets":
        return _presets(args.json)
    if args.command == "serve":
        return _served(args)
    recompute = f"every-{args.every}" if args.recompute == "every-k" else args.recompute
    if args.seq > args.model.max_seq:   # as plan does: the RoPE tables cover the sequence asked for
        args.model = args.model.replace(max_seq=args.seq)
    step = dict(batch=args.batch, seq=args.seq, precision=args.precision,
                optimizer=args.optimizer, recompute=recompute,
                optimizer_impl=args.optimizer_impl, device=args.device,
                lora_rank=args.lora_rank, attention=args.attention,
                optimizer_in_backward=args.optimizer_in_backward,
                **fine_tuning_fields(args.trainable))
    result, extra, title = (_estimated if args.command == "estimate" else _measured)(args, step)
    if args.json:
        return json.dumps({**result.as_dict(), **extra}, indent=2, default=str)
    return _table(title, result, extra)


def _presets(as_json: bool) -> str:
    rows = {name: count_params(name) for name in presets()}
    if as_json:
        return json.dumps({n: {"total": p.total, "active": p.active,
                               "published": preset(n).published} for n, p in rows.items()},
                          indent=2)
    lines = [f"{'preset':<18}{'parameters':>18}{'active':>18}  published"]
    lines += [f"{n:<18}{p.total:>18,}{p.active:>18,}  {preset(n).published}"
              for n, p in rows.items()]
    return "\n".join(lines)


def _served(args) -> str:
    """serve: the pool per GPU, as a table or JSON."""
    from labkit.training.serving import size_block_pool   # imports torch: here, not at start
    length = args.max_model_len or args.model.max_seq
    pool = size_block_pool(args.model, args.gpu, args.gpu_memory_utilization,
                           args.max_num_batched_tokens, args.max_num_seqs, args.block_size,
                           args.dtype, args.kv_dtype, int(args.other_gib * 2**30), args.tp, length)
    if args.json:
        return json.dumps(pool.as_dict(length), indent=2)
    return (f"{args.model.name} on {args.tp} x {args.gpu.name} ({fmt_bytes(args.gpu.memory)}, "
            f"the table's; CUDA reports ~0.5 GiB less): a vLLM-style server's memory per GPU\n"
            f"(profiling run: {args.max_num_batched_tokens:,} tokens over {args.max_num_seqs} "
            f"requests, labkit's model on fake tensors; vLLM's defaults for these depend on its "
            f"version and GPU: pass what your server logs)\n" + pool.table(length))


def _estimated(args, step: dict) -> tuple:
    """(the estimate, what is shown beside its table, the title) of ``estimate``."""
    chunks = args.virtual_stages or (INTERLEAVED_CHUNKS if args.schedule == "interleaved" else 1)
    layout = Layout(dp=args.dp, zero_stage=args.zero_stage, tp=args.tp, sp=args.sp, pp=args.pp,
                    micro_batches=args.micro_batches, schedule=args.schedule, etp=args.etp,
                    virtual_stages=chunks, ep=args.ep, cp=args.cp, replicas=args.replicas,
                    param_dtype=args.param_dtype, gradient_as_bucket_view=args.bucket_view,
                    offload=args.offload)
    result = estimate(args.model, layout=layout, **step)
    extra = {**result.details, MOMENTS: result.moments}          # bytes as int in JSON
    if args.json:
        extra["tensors"] = [dataclasses.asdict(t) for t in result.tensors]
    else:
        extra[MOMENTS] = {k: fmt_bytes(v) for k, v in result.moments.items()}
        if args.explain:
            extra["tensors alive at the peak"] = "\n" + result.explain()
    if args.gpu:
        extra["fits " + args.gpu.name] = _fits(result.total, args.gpu)
    title = (f"{args.model.name}: predicted bytes per device, {args.device} defaults\n(batch "
             f"{args.batch}, seq {args.seq}, {args.precision}, {args.optimizer}, "
             f"ZeRO-{args.zero_stage}{'-Offload' if args.offload else ''}"
             f"{f' over dp x cp = {args.dp * args.cp}' if args.zero_stage and args.cp > 1 else ''}, "
             f"dp {args.dp}, "
             f"tp {args.tp}{' with sp' if args.sp else ''}, "
             f"pp {args.pp}, ep {args.ep}{f' x etp {args.etp}' if args.etp > 1 else ''}, "
             f"cp {args.cp})")
    return result, extra, title


def _fits(total: int, g) -> str:
    """Whether a step's peak fits ``g`` with the planner's headroom, and by how much."""
    usable = usable_memory(g)
    verdict = (f"yes, {fmt_bytes(usable - total)} to spare" if total <= usable
               else f"no, {fmt_bytes(total - usable)} over")
    return (f"{verdict} ({fmt_bytes(usable)} usable: {fmt_bytes(g.memory)} less "
            f"{HEADROOM:.0%} for the CUDA context, NCCL and fragmentation)")


def _measured(args, step: dict) -> tuple:
    """(the measurement, what is shown beside its table, the title) of ``measure``."""
    import torch                            # here: estimate, plan, presets and doctor need none

    from labkit.training.measure import measure_step

    if args.real and args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--real --device cuda, but CUDA is not available here: use "
                         "--device cpu (or leave --device out), or drop --real to measure "
                         "fake tensors with CUDA's defaults")
    result = measure_step(args.model, fake=not args.real, **step)
    extra = {"tensors": (f"fake (shapes only), {result.device} defaults" if result.fake
                         else f"real, on {result.device}"),
             "optimizer implementation": result.optimizer_impl}
    if result.cuda_peak is not None:
        extra["torch.cuda.max_memory_allocated"] = result.cuda_peak
    title = (f"{args.model.name}: measured bytes at the peak of one training step\n"
             f"(batch {args.batch}, seq {args.seq}, {args.precision}, {args.optimizer})")
    return result, extra, title


def _show(args) -> int:
    """Print what the command computes: 0; or on bad input one line naming the fix: 2."""
    try:
        print(_run(args))
    except ValueError as error:       # the library's messages name the fix, in Python's words
        print(f"{PROG} {args.command}: error: {_as_flags(str(error), set(vars(args)))}",
              file=sys.stderr)
        return 2
    return 0


def _as_flags(message: str, options: set) -> str:
    """A library message in the command line's words: ``Layout(dp=3, ep=3)`` and ``tp=3``
    become ``--dp 3 --ep 3`` and ``--tp 3`` where the command has those options."""
    def flag(name: str, value: str) -> str:
        return f"--{name.replace('_', '-')} {value}"

    def call(match):                  # (lk.)Layout(...) / Recipe(...) of options only
        pairs = re.findall(r"(\w+)=('?)([^,'()]+)\2", match.group(1))
        if pairs and all(name in options for name, _, _ in pairs):
            return " ".join(flag(name, value) for name, _, value in pairs)
        return match.group(0)

    message = re.sub(r"(?:lk\.)?(?:Layout|Recipe)\(([^()]*)\)", call, message)
    return re.sub(r"(?<![\w.-])(\w+)=('?)([\w.-]+)\2",
                  lambda m: flag(m.group(1), m.group(3)) if m.group(1) in options else m.group(0),
                  message)


def _course(args) -> int:
    """doctor --course: one line per check and a verdict (or JSON); 1 when a check fails."""
    # changes nothing on the host: it reads, and runs one notebook in a scratch folder
    from labkit.course.doctor import SMOKE_BUDGET_S, SMOKE_NOTEBOOK, course_report
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
    try:
        code = _course(args) if args.command == "doctor" and args.course else _show(args)
        sys.stdout.flush()            # a reader that left shows here, not at the exit's flush
    except BrokenPipeError:           # `| head` has what it wanted: stop as Unix tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())     # the exit's flush of the rest goes nowhere
        os.close(devnull)
        return EXIT_SIGPIPE
    return code


if __name__ == "__main__":
    sys.exit(main())
