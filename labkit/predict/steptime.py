"""A stated model of one training step's time: compute at an assumed MFU, plus communication.

Simple on purpose, every assumption returned in words (``assumptions``) for the planner to
print. Compute is the "6 N D" rule of Kaplan et al. (2020) over the active parameters
(DeepSeek-V3's MoE: 37B of 671B), plus attention's s^2 FLOPs (PaLM's 12 L H d s per token,
halved by the causal mask), divided by the GPUs' dense bf16 peak times an assumed MFU.
Collectives are rings: an all-reduce of S bytes over n ranks sends 2 (n - 1) / n S per rank, a
reduce-scatter or all-gather (n - 1) / n S (Patarasuk and Yuan, 2009); ZeRO's 2 Psi / 3 Psi
(Rajbhandari et al., 2020); Megatron-LM's tensor parallelism all-reduces b s h activations
twice in each layer's forward and twice in its backward (Shoeybi et al., 2019); the pipeline
idles for ``labkit.pipeline_bubble``; expert parallelism sends each token's top-k rows out and
back (all_to_all) in the forward and again in the backward (DeepSeek-V3, section 3.2). Nothing
overlaps: the parts add up (``StepTime.total``); ``StepTime.overlapped`` is the other end, what
frameworks can hide under compute hidden, so a ranking can be checked against both.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from labkit.core.recipe import V_SCHEDULES
from labkit.parallel.data.zero import zero_messages
from labkit.predict.papers import pipeline_bubble

MFU = 0.4            # model FLOPs utilisation assumed for the matmuls
# extra work of each recompute policy, in units of 2 N D (one forward pass)
RECOMPUTE_EXTRA = {"none": 0.0, "selective": 0.125, "full": 1.0}
STREAM_BYTES = 2     # bf16 activations, gradients and gathered weights on the wire
# DRAM traffic of ZeRO-Offload's CPU AdamW step per parameter, as DeepSpeed runs it: the CPU
# reads the fp32 master, m, v and gradient (cast to fp32 on the GPU before the copy) and writes
# back master, m, v and the 16-bit weight (16 + 14); the copies write the gradient into DRAM
# and read the weight out (4 + 2). torch's fp32 AdamW alone touches 28 (16 read, 12 written).
HOST_STEP_BYTES = 36
HOST_EFFICIENCY = 0.8        # of the theoretical DRAM bandwidth a streaming kernel reaches
OFFLOAD_GRAD_BYTES = 4       # gradient shards cross PCIe in fp32 (DeepSpeed's offload)
# bitsandbytes dequantises each NF4 weight before its matmul: it writes the double-quantised
# scales out as fp32 and adds their offset (three passes over 4 B per 64 weights), reads the
# codes (0.5 B) and the 8-bit scales (1/64 B), and writes the bf16 weight (2 B) the matmul
# then reads, as it would read LoRA's bf16 weight anyway
DEQUANT_BYTES = 0.5 + 1 / 64 + 3 * 4 / 64 + 2
HBM_EFFICIENCY = 0.8         # of the GPU's memory bandwidth a streaming kernel reaches


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step, by part (``total`` is their sum: no overlap): ``offload``
    is the PCIe copies of ZeRO-Offload, ``host_step`` its CPU optimizer step."""

    compute: float
    bubble: float
    dp: float
    tp: float
    pp: float
    ep: float
    offload: float
    host_step: float = 0.0
    dequant: float = 0.0
    cp: float = 0.0
    attention: float = 0.0      # attention's s^2 FLOPs (``compute`` is the matmuls' 6 N D)
    dp_window: float = -1.0     # the compute data parallel's traffic can hide under (-1: all)

    @property
    def total(self) -> float:
        return (self.compute + self.attention + self.dequant + self.bubble + self.dp + self.tp
                + self.pp + self.ep + self.cp + self.offload + self.host_step)

    @property
    def dp_overlapped(self) -> float:
        """Seconds as data-parallel frameworks run a step by default, what the planner ranks
        by: data parallel's collectives hidden under ``dp_window`` (ZeRO-3: FSDP's prefetched
        gathers and every backward's reduce-scatter, the whole compute; ZeRO-2: every
        backward; DDP and ZeRO-1: the last micro-batch's backward), the rest exposed."""
        window = self.compute + self.attention if self.dp_window < 0 else self.dp_window
        return self.total - self.dp + max(0.0, self.dp - window)

    @property
    def overlapped(self) -> float:
        """Seconds with every collective frameworks overlap hidden under the compute, as far as
        it lasts: data parallel's (DDP's bucketed all-reduce, ZeRO's prefetched gathers), the
        pipeline's sends and expert parallel's all-to-all (DualPipe); the context-parallel
        ring's K/V only under the attention (the next block travels while this one's attention
        computes). Tensor parallel's all-reduces sit between a layer's matmuls and stay
        exposed, as do offload's copies and its host step."""
        work = self.compute + self.attention
        ring = min(self.cp, self.attention)           # the ring's part under the attention
        hidden = self.dp + self.pp + self.ep          # under what the ring left uncovered
        return (work + self.dequant + self.bubble + self.tp + (self.cp - ring) + self.offload
                + self.host_step + max(0.0, hidden - (work - ring)))

    def as_dict(self) -> dict:
        parts = {k: v for k, v in asdict(self).items() if k != "dp_window"}
        return {**parts, "total": self.total}            # the parts and their sum


def ring(n: int, nbytes: float, collective: str) -> float:
    """Bytes one rank sends in a ring collective over n ranks."""
    share = (n - 1) / n
    return nbytes * (2 * share if collective == "all-reduce" else share)


def _data_parallel_bytes(zero_stage: int, m: int, ranks: int, grads: int, frozen: int = 0) -> float:
    """What one rank sends per step to average ``grads`` bytes over ``ranks``: DDP's all-reduce,
    or ZeRO's reduce-scatter of the gradients and all-gather of the updated weights (stages 2-3
    keep only a gradient shard: a reduce-scatter per micro-batch; stage 3 gathers the weights,
    a ``frozen`` base too, before each forward and backward)."""
    if zero_stage == 0:
        return ring(ranks, grads, "all-reduce")
    scatters, gathers = zero_messages(zero_stage, m)
    return (scatters * ring(ranks, grads, "reduce-scatter")
            + gathers * ring(ranks, grads + (frozen if zero_stage == 3 else 0), "all-gather"))


def _data_parallel_time(zero_stage: int, m: int, dp: int, cp: int, tp: int, ep: int,
                        replicas: int, grads: float, expert_grads: float, frozen: float,
                        gpus_per_node: int, intra: float, inter: float) -> float:
    """Seconds of data parallel's collectives: every cp rank holds the weights too, so ZeRO
    shards over dp x cp (under HSDP one replica's share of them, each gradient shard then
    all-reduced across the replicas); with ep each expert shard over its dp / ep copies."""
    if dp * cp == 1:
        return 0.0
    shard = dp * cp // replicas                     # the ranks ZeRO shards over
    sent = _data_parallel_bytes(zero_stage, m, shard, grads, frozen)
    if ep > 1:            # each expert shard over its dp / ep copies, by the same ZeRO stage
        sent += _data_parallel_bytes(zero_stage, m, dp // ep, expert_grads)
    seconds = sent / (intra if tp * shard <= gpus_per_node else inter)
    if replicas > 1:      # HSDP: each gradient shard all-reduced across, after its reduce-scatter
        scatters, _ = zero_messages(zero_stage, m)
        seconds += scatters * ring(replicas, grads / shard, "all-reduce") / (
            intra if tp * dp * cp <= gpus_per_node else inter)
    return seconds


def step_time(gpu, *, gpus: int, gpus_per_node: int, active_params: int, hidden: int,
              top_k: int, seq: int, global_batch: int, micro: int, dp: int, tp: int, pp: int,
              ep: int, zero_stage: int, offload: bool, schedule: str, v: int,
              recompute: str, lora: bool, rank_params: int, rank_expert_params: int,
              stage_layers: int, stage_moe_layers: int, mfu: float = MFU,
              frozen_params: int = 0, frozen_bytes: float = STREAM_BYTES,
              nf4_params: int = 0, cp: int = 1, kv_width: int = 0,
              attention_flops: float = 0.0, replicas: int = 1) -> StepTime:
    """The modelled time of one step. ``rank_params``: trainable parameters one rank of the
    busiest stage holds outside the routed experts, ``rank_expert_params`` inside them;
    ``frozen_params``: those without gradients that ZeRO-3 gathers too (LoRA's base), of
    ``frozen_bytes`` each (QLoRA's NF4: about half a byte); ``nf4_params``: the frozen weights
    this rank dequantises for every forward, recomputed forward and backward (QLoRA); ``cp``
    context-parallel ranks passing ``kv_width`` numbers of keys and values per token and layer
    round a ring; ``attention_flops``: one sequence's causal attention forward, every layer
    (``attention_forward_flops``); ``replicas``: HSDP, ZeRO inside groups of dp x cp / replicas
    ranks, each gradient shard all-reduced over the replicas."""
    tokens = global_batch * seq
    m = global_batch // (dp * micro)                    # micro-batches per step on a rank
    passes = (2 if lora else 4) + 2 * RECOMPUTE_EXTRA[recompute]   # LoRA: no weight grads
    flops = gpus * gpu.bf16_tflops * 1e12 * mfu                 # what the GPUs do per second
    compute = (2 + passes) * active_params * tokens / flops
    forwards = 2 if recompute == "full" else 1
    # forward, backward (2x), and full recompute's forward again; selective keeps attention's
    # output (torchtitan's policy), so it does not run attention again
    attention = (forwards + 2) * attention_flops * global_batch / flops
    dequant = (forwards + 1) * m * nf4_params * DEQUANT_BYTES / (gpu.hbm_gbps * 1e9
                                                                  * HBM_EFFICIENCY)
    bubble = 0.0
    if pp > 1:
        idle = pipeline_bubble(pp, m, schedule, v)
        bubble = (compute + attention) * idle / (1 - idle)
    intra, inter = gpu.intra_node_gbps * 1e9, gpu.inter_node_gbps * 1e9
    # ranks are placed tp innermost, then cp, then ep inside dp, then pp (Megatron-LM's order)
    # without ep the routed experts are replicated like every other weight: their gradients
    # cross the dp group too; with ep each expert shard is averaged over its dp / ep copies
    grads = (rank_params + (rank_expert_params if ep == 1 else 0)) * STREAM_BYTES
    dp_time = _data_parallel_time(zero_stage, m, dp, cp, tp, ep, replicas, grads,
                                  rank_expert_params * STREAM_BYTES,
                                  frozen_params * frozen_bytes, gpus_per_node, intra, inter)
    layer_rows = micro * seq // cp * hidden * STREAM_BYTES  # a micro-batch's b s h on this rank
    tp_time = 0.0
    if tp > 1:            # 2 all-reduces per forward (attention, MLP), 2 per backward
        tp_time = (2 * forwards + 2) * stage_layers * m * ring(tp, layer_rows, "all-reduce") / intra
    pp_time = 0.0
    if pp > 1:            # one activation out and one gradient back per micro-batch and chunk
        pp_bw = inter if gpus // pp >= gpus_per_node else intra
        chunks = 2 if schedule in V_SCHEDULES else v
        pp_time = 2 * m * chunks * layer_rows / tp / pp_bw
    ep_time = 0.0
    if ep > 1:            # dispatch and combine, forward (and recomputed) and backward
        ep_bw = intra if tp * ep <= gpus_per_node else inter
        rows = layer_rows * top_k * (ep - 1) / ep
        ep_time = 2 * (forwards + 1) * stage_moe_layers * m * rows / ep_bw
    cp_time = 0.0
    if cp > 1:            # the ring: K/V cp - 1 hops per forward (recomputed too) and backward,
        kv = micro * seq // cp * kv_width // tp * STREAM_BYTES   # their gradient cp hops; tp
        # splits the heads, so each rank passes its heads' K/V
        cp_bw = intra if tp * cp <= gpus_per_node else inter
        cp_time = stage_layers * m * ((forwards + 1) * (cp - 1) + cp) * kv / cp_bw
    offload_time, host_time = (_offload_times(gpu, (rank_params + rank_expert_params) / (dp * cp),
                                              frozen_params / (dp * cp), frozen_bytes,
                                              zero_stage, m) if offload else (0.0, 0.0))
    # where dp's traffic hides: ZeRO-3's gathers are prefetched under the forward and its
    # reduce-scatters run in every backward (FSDP), so under all the compute; ZeRO-2
    # reduce-scatters in every backward (FSDP's SHARD_GRAD_OP; DeepSpeed with overlap_comm,
    # off by default below stage 3); DDP and ZeRO-1 reduce once, in the last micro-batch's
    # backward (DDP's no_sync, Megatron's --overlap-grad-reduce; DeepSpeed's stage 1 only with
    # overlap_comm, like DDP)
    backward = (compute + attention) * passes / (2 + passes)       # every micro-batch's
    window = -1.0 if zero_stage == 3 else backward if zero_stage == 2 else backward / m
    return StepTime(compute, bubble, dp_time, tp_time, pp_time, ep_time, offload_time, host_time,
                    dequant, cp_time, attention, window)


def _offload_times(gpu, shard: float, frozen: float, frozen_bytes: float, zero_stage: int,
                   m: int) -> tuple[float, float]:
    """ZeRO-Offload's (PCIe seconds, host step seconds) for this rank's ``shard`` of trained
    parameters and ``frozen`` ones: gradient shards down, updated weight shards up (stage 3:
    per gather, a frozen base's shards too), then the host's AdamW over the shard, bound by
    this rank's share of the node's DRAM."""
    up = 2 * m if zero_stage == 3 else 1
    frozen = frozen if zero_stage == 3 else 0
    pcie = ((shard * (OFFLOAD_GRAD_BYTES + up * STREAM_BYTES) + frozen * up * frozen_bytes)
            / (gpu.pcie_gbps * 1e9))
    return pcie, HOST_STEP_BYTES * shard / (gpu.host_gbps * 1e9 * HOST_EFFICIENCY)


def attention_forward_flops(c, seq: int) -> float:
    """FLOPs of one sequence's causal attention forward, every layer: q k^T and p v, each
    2 s^2 x heads x head dim, halved by the mask (MLA: its q/k and v widths)."""
    qk, v = (c.qk_head_dim, c.v_head_dim) if c.attention == "mla" else (c.head_dim, c.head_dim)
    return seq * seq * c.layers * c.heads * (qk + v)


RANKING = ("the ranking adds compute, bubble and every collective but data parallel's, which "
           "hides as the frameworks run it: ZeRO-3 (FSDP) prefetches its gathers and "
           "reduce-scatters in every backward (hidden under all the compute), ZeRO-2 "
           "reduce-scatters in every backward (FSDP's SHARD_GRAD_OP), DDP and ZeRO-1 reduce in "
           "the last micro-batch's backward (DDP's no_sync, Megatron's --overlap-grad-reduce); "
           "DeepSpeed's stages 1 and 2 overlap only with overlap_comm: true (default false "
           "below stage 3), stage 1 then reducing in the last micro-batch's backward, like DDP; "
           "times within 2% are ties, ordered by the larger micro-batch, fewer model-parallel "
           "dimensions, foreach AdamW before 8-bit or fused AdamW, then the smaller peak; the "
           "line 'overlap:' re-ranks the layouts found with all of dp's, pp's and ep's "
           "communication hidden under the compute (DualPipe, Megatron's overlap options) and "
           "cp's under attention (tp's, offload's and the host step stay exposed; Megatron's "
           "--tp-comm-overlap would hide some of tp's): what the default frameworks do, and the "
           "most a framework hides")


def assumptions(gpu, gpus_per_node: int, mfu: float = MFU) -> list[str]:
    """What ``step_time`` assumes, in words, with the numbers it used."""
    return [
        f"compute: (6 + recompute) x active parameters (less the input embedding, a lookup) x "
        f"tokens, plus attention's s^2 FLOPs (3 x s^2 x layers x heads x (qk + v head dims) "
        f"per sequence: forward and 2x backward, causal, the MFU convention - FlashAttention's "
        f"backward does about 2.5x, recomputing the scores; full recompute once more), / (GPUs x "
        f"{gpu.bf16_tflops:g} TFLOP/s bf16 dense x MFU {mfu:g})",
        "MFU is the same for every layout: it does not fall with tp's smaller matmuls, small "
        "expert GEMMs or grouped-GEMM MoE kernels (real MoE fine-tuning often runs well under "
        "0.4), so layouts that split small matrices look better than they are",
        "recompute adds forward work: full 2 N D (8/6 of a full fine-tuning step, 6/4 of "
        "LoRA's), selective an eighth of a forward (assumed); checkpointing every k-th layer "
        "is not searched; LoRA/QLoRA do 4 N D (no weight gradients of the frozen model), and "
        "their adapters' own collectives (their gradients' all-reduce, their tensor-parallel "
        "messages) are not timed",
        f"QLoRA dequantises every NF4 weight of the blocks before each forward, recomputed "
        f"forward and backward matmul, as bitsandbytes' unfused path does: {DEQUANT_BYTES:.2f} "
        f"bytes of GPU memory traffic per weight (codes and scales read, the bf16 copy "
        f"written) at {HBM_EFFICIENCY:.0%} of {gpu.hbm_gbps:g} GB/s (dequant), not overlapped; "
        f"the kernels' launch costs are not modelled (bitsandbytes' fused 4-bit matmul runs "
        f"only where no gradient is needed); labkit's own QuantLinear, which goes through fp32, is "
        f"slower",
        "micro-batch size changes no modelled time but the pipeline's bubble and message count; "
        "ties go to the larger micro-batch (better utilisation in practice, not modelled)",
        f"rings: all-reduce 2(n-1)/n x bytes, reduce-scatter and all-gather (n-1)/n; bf16 on the "
        f"wire; {gpu.intra_node_gbps:g} GB/s per GPU inside a node of {gpus_per_node}, "
        f"{gpu.inter_node_gbps:g} GB/s across nodes; a group uses the slower link when it "
        f"spans nodes (ranks placed tp, then cp, then ep inside dp, then pp)",
        "data parallel: the gradients (the routed experts' too, unless ep splits them) "
        "all-reduced once per step (DDP, ZeRO-0), or reduce-scattered - once per step with "
        "ZeRO-1, once per micro-batch with ZeRO-2/3, which keep only a shard - and the weights "
        "all-gathered once (ZeRO-1/2) or before each micro-batch's forward and backward (ZeRO-3); "
        "with ep, each expert shard's by the same rule over its dp / ep copies; HSDP: the "
        "reduce-scatters and all-gathers inside a node's group, each gradient shard then "
        "all-reduced across the replicas (FSDP's HYBRID_SHARD)",
        "tensor parallel (Megatron-LM, with sequence parallelism: same bytes): 4 all-reduces "
        "of b s h per layer and micro-batch (6 with full recompute), inside a node only",
        "pipeline: idle fraction from labkit.pipeline_bubble; one activation and one gradient "
        "of b s h / tp per micro-batch and chunk between stages (interleaved: v chunks, ZB-V: "
        "2 in a V)",
        "expert parallel: all_to_all of tokens x top_k x hidden out and back per MoE layer, in "
        "the forward and the backward (again with full recompute), balanced routing",
        "context parallel (ring attention, labkit.parallel.context): each layer passes its "
        "heads' K/V block (1/tp of them) cp - 1 hops in the forward (again with full "
        "recompute) and in the backward, and its gradient cp hops, in bf16 (torch's "
        "context_parallel sends the gradient in fp32); overlapped, a hop hides only under "
        "attention's compute; the cp ranks average their gradients with the dp ranks, ZeRO "
        "shards over dp x cp",
        f"offload: fp32 gradient shards down and bf16 weight shards up over PCIe at "
        f"{gpu.pcie_gbps:g} GB/s (theoretical), then the host's AdamW over this rank's shard "
        f"(host_step): {HOST_STEP_BYTES} bytes of DRAM traffic per parameter as DeepSpeed runs "
        f"it, at {HOST_EFFICIENCY:.0%} of {gpu.host_gbps:g} GB/s, this GPU's share of the node's "
        f"theoretical DRAM bandwidth (host_gbps, --host-gbps). That assumes a vectorised CPU "
        f"Adam (DeepSpeed's, or torch's fused=True); torch's CPU default, a for-loop, and its "
        f"foreach are several times slower (benchmarks/cpu_adam.py). Not overlapped with the "
        f"GPUs' work: the ZeRO-Offload paper's one-step delayed update, not in DeepSpeed's "
        f"default path, would hide it. The planner checks the host memory apart (host_ram)",
        RANKING,
    ]
