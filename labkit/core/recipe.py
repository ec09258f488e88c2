"""The course's vocabulary for a training step: what it stores (a ``Recipe``) and how it is
spread over devices (a ``Layout``). One name, one meaning, in the library, the command line,
the plots and the notebooks.

Precisions (bytes per parameter of weights, gradients, each optimizer-state number, master):

| precision                 | weights | grads | state | master | note                         |
| ------------------------- | ------- | ----- | ----- | ------ | ---------------------------- |
| fp32                      | 4       | 4     | 4     | -      |                              |
| bf16                      | 2       | 2     | 2     | -      | "pure" bf16                  |
| bf16-master, fp16-master  | 2       | 2     | 4     | 4      | ZeRO's "mixed precision"     |
| bf16-mixed, fp16-mixed    | 4       | 4     | 4     | -      | autocast: + 2-byte copies    |

bf16-master is the ZeRO paper's 2 + 2 + 12 bytes with AdamW (under ZeRO labkit keeps the
averaged gradient shards in fp32: ZeRO-3 holds (2 + 4 + 12) / N once they exist). The mixed
names are PyTorch Lightning's; autocast's 16-bit weight copies are their own category.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.core.recompute import parse_policy
from labkit.core.units import check_choice, check_positive

PRECISIONS = ("fp32", "bf16", "bf16-master", "fp16-master", "bf16-mixed", "fp16-mixed")
OPTIMIZERS = ("adamw", "sgd", "sgd-momentum", "adamw-8bit")
OPTIMIZER_IMPLS = ("for-loop", "foreach", "fused")
DEVICES = ("cuda", "cpu")
TRAINABLE = ("all", "lora")      # every parameter, or LoRA adapters on a frozen model (lab 06)
# the pipeline schedules modelled; ZB-V and DualPipeV put two chunks per stage in a V
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v")
PARAM_DTYPES = ("bf16",)             # Layout.param_dtype: FSDP2's MixedPrecisionPolicy(param_dtype)
V_SCHEDULES = ("zb-v", "dualpipe-v")
SPLIT_BACKWARD = ("zb-h1", *V_SCHEDULES)      # B (input gradients) and W (weights') apart


def placement_of(schedule: str) -> str:
    """"v" for the schedules that put two chunks a stage in a V (ZB-V, DualPipeV), else "loop"."""
    return "v" if schedule in V_SCHEDULES else "loop"
WEIGHT_FORMATS = (None, "nf4")   # how frozen weights are stored: the precision's, or QLoRA's NF4
FINE_TUNING = ("all", "lora", "qlora")   # what a user asks for: the planner's and CLI's words


def fine_tuning_fields(name: str) -> dict:
    """``Recipe``'s trainable and weight_format for a FINE_TUNING name ("qlora": LoRA on NF4)."""
    if name not in FINE_TUNING:
        raise ValueError(f"unknown fine-tuning {name!r}; use one of {', '.join(FINE_TUNING)}")
    return dict(trainable="all" if name == "all" else "lora",
                weight_format="nf4" if name == "qlora" else None)
LORA_TARGETS = ("all-linear",)
# the attention cores of labkit.transformer.attention: fused, (T, T) probabilities, online softmax
ATTENTION_IMPLS = ("sdpa", "naive", "tiled")
# optimizer-state numbers kept per parameter, and the bytes of one when not the precision's
STATE_NUMBERS = {"adamw": 2, "sgd": 0, "sgd-momentum": 1, "adamw-8bit": 2}
EIGHT_BIT = {"adamw-8bit"}


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state under a precision and optimizer."""

    weights: int
    grads: int
    optimizer: int               # moments (and masters, for the -master precisions)
    weight_cache: int            # autocast's low-precision copy of each matmul weight

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


def state_bytes(precision: str, optimizer: str = "adamw") -> StateBytes:
    """Bytes per parameter of weights, gradients and optimizer state (the table above)."""
    check_choice("precision", precision, PRECISIONS)
    check_choice("optimizer", optimizer, OPTIMIZERS)
    sixteen_bit_weights = precision in ("bf16", "bf16-master", "fp16-master")
    stored = 2 if sixteen_bit_weights else 4
    master = 4 if precision.endswith("-master") else 0
    number = 1 if optimizer in EIGHT_BIT else (4 if master else stored)
    return StateBytes(weights=stored, grads=stored,
                      optimizer=STATE_NUMBERS[optimizer] * number + master,
                      weight_cache=2 if precision.endswith("-mixed") else 0)


def compute_bytes(precision: str) -> int:
    """Bytes of one number the matmuls produce: 4 in fp32, 2 otherwise."""
    check_choice("precision", precision, PRECISIONS)
    return 4 if precision == "fp32" else 2


def check_loss_chunk(loss_chunk) -> int | None:
    """``loss_chunk``: None (full logits) or a positive number of tokens; else ValueError."""
    if loss_chunk is not None:
        return check_positive("loss_chunk (tokens per chunk; None for the full logits)",
                              loss_chunk)
    return None


def default_optimizer_impl(device: str) -> str:
    """What ``torch.optim.AdamW()`` runs when left to choose: foreach on CUDA, a for-loop on CPU."""
    device = device_type(device)
    return "foreach" if device == "cuda" else "for-loop"


def device_type(device) -> str:
    """"cuda" or "cpu" from a name, "cuda:1" or a torch.device; ValueError naming them."""
    kind = str(device).partition(":")[0]
    check_choice("device", kind, DEVICES)
    return kind


@dataclass(frozen=True)
class Recipe:
    """What one training step stores and recomputes, whatever the devices.

    ``optimizer_impl``: AdamW's implementation; None takes the device's default.
    ``recompute``: a ``labkit.transformer.checkpointing`` policy (``every`` is k of "every-k").
    ``trainable``: which parameters train: "all", or "lora" (``labkit.quantisation.lora``: the model
    frozen, rank-``lora_rank`` adapters on ``lora_targets``). ``weight_format``: how the frozen
    targeted weights are stored: None (the precision's own) or "nf4" (QLoRA; only with "lora"). Both
    compose with every recompute policy (blocks rerun with their adapters; an NF4 weight's
    dequantised copy is a transient either way) and every precision (under autocast, the
    matmuls in 16 bits over frozen weights stored in fp32 or NF4, as QLoRA computes in bf16).
    ``loss_chunk``: None computes the (tokens, vocab)
    logits at once; n runs the LM head and the loss n tokens at a time
    (``labkit.transformer.loss``).
    ``attention``: the attention core (``labkit.transformer.attention``): "sdpa" (PyTorch's
    fused kernel), "naive" (keeps the (T, T) probabilities) or "tiled" (labkit's online
    softmax).
    ``autocast_cache``: torch.autocast keeps its bf16 cast of every fp32 leaf weight that
    trains until the autocast region ends (its default); False is ``torch.autocast(...,
    cache_enabled=False)``, each matmul casting anew (what FSDP's bf16 ``param_dtype`` also
    avoids). With recomputation the cached copies outlive the layers that used them.
    ``bf16-mixed`` under ZeRO-3 is FSDP without ``param_dtype``: autocast over fp32 shards,
    gathered in fp32, not FSDP2's ``MixedPrecisionPolicy`` (bf16 gathers; lab 04 measures it).
    ``optimizer_in_backward``: each parameter is updated by a hook as soon as its gradient is
    made, and the gradient freed (``labkit.training.in_backward``): no step holds every gradient.
    """

    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    optimizer_impl: str | None = None
    recompute: str = "none"
    every: int = 2
    trainable: str = "all"
    weight_format: str | None = None
    loss_chunk: int | None = None
    lora_rank: int = 16
    lora_targets: str = "all-linear"
    attention: str = "sdpa"
    autocast_cache: bool = True
    optimizer_in_backward: bool = False

    def __post_init__(self):
        if not isinstance(self.autocast_cache, bool):
            raise ValueError(f"autocast_cache is True (torch.autocast's default) or False "
                             f"(cache_enabled=False), got {self.autocast_cache!r}")
        self._check_in_backward()
        object.__setattr__(self, "every", check_positive("every", self.every))
        object.__setattr__(self, "loss_chunk", check_loss_chunk(self.loss_chunk))
        state_bytes(self.precision, self.optimizer)
        if self.optimizer_impl is not None:
            check_choice("optimizer implementation", self.optimizer_impl, OPTIMIZER_IMPLS)
        parse_policy(self.recompute, self.every)
        check_choice("trainable", self.trainable, TRAINABLE)
        check_choice("weight_format", self.weight_format, WEIGHT_FORMATS)
        object.__setattr__(self, "lora_rank", check_positive("lora_rank", self.lora_rank))
        check_choice("lora_targets", self.lora_targets, LORA_TARGETS)
        if self.weight_format is not None and self.trainable != "lora":
            raise ValueError(f"weight_format={self.weight_format!r} stores the frozen weights "
                             f"under trainable adapters: pass trainable='lora' (QLoRA), or leave "
                             f"weight_format None")
        check_choice("attention", self.attention, ATTENTION_IMPLS)
        if self.attention != "sdpa" and self.recompute == "selective":
            raise ValueError(f"recompute='selective' keeps the outputs of fused attention "
                             f"kernels; with attention={self.attention!r} it would keep every "
                             f"(T, T) score matrix (or tile): use attention='sdpa', or a "
                             f"recompute policy that reruns whole blocks ('full', 'every-k', "
                             f"'sqrt')")

    def _check_in_backward(self):
        """The step in backward updates each weight alone: nothing may need every gradient."""
        if not isinstance(self.optimizer_in_backward, bool):
            raise ValueError(f"optimizer_in_backward is True or False, got "
                             f"{self.optimizer_in_backward!r}")
        if self.optimizer_in_backward and self.precision.endswith("-master"):
            raise ValueError(f"optimizer_in_backward with {self.precision!r}: labkit's master "
                             f"weights copy every gradient at the step; use 'bf16' or "
                             f"'bf16-mixed'")
        if self.optimizer_in_backward and self.precision == "fp16-mixed":
            raise ValueError("optimizer_in_backward with 'fp16-mixed': the loss scaler checks "
                             "every gradient for inf before any update; use 'bf16-mixed'")

    def impl(self, device: str) -> str:
        """AdamW's implementation on ``device``: the one chosen, or the device's default."""
        return self.optimizer_impl or default_optimizer_impl(device)


@dataclass(frozen=True)
class Layout:
    """How one step is spread over devices; every degree is 1 on a single device.

    ``dp`` data parallel with ZeRO ``zero_stage`` (0-3; 0 is DDP, whose gradient buckets hold
    a second copy of the gradients unless ``gradient_as_bucket_view``; ``offload`` keeps ZeRO's
    optimizer state, master weights and gradient shards - from stage 3 the parameter shards too -
    in host memory, where the step runs); ``tp`` tensor parallel, with ``sp``
    sequence parallelism over the same group; ``pp`` pipeline stages running
    ``micro_batches`` (None: ``pp``, the fewest that fill a 1F1B pipeline) under
    ``schedule``; ``ep`` expert parallel: the routed experts split over groups of ``ep`` of the
    ``dp`` data-parallel ranks (Megatron-LM's convention; DeepSeek-V3: 64-way inside its data
    parallelism), so ep divides dp and each expert shard has dp / ep copies (dp x cp / ep with
    cp); the replicated weights are averaged over all dp ranks
    (``labkit.parallel.expert.compose``); ``cp`` context parallel (the sequence split over
    ``cp`` ranks; ZeRO and the gradients' average span dp x cp, ``data_ranks``).
    ``ddp_buckets``: whether data parallelism
    keeps DDP's flat gradient buckets (True) or averages each gradient in place after the
    backward pass (False, as labkit.parallel.expert.expert_parallel's step does at any ep); None:
    True for plain data parallelism (ep = 1), False with ep > 1. ``replicas``: HSDP (FSDP's
    hybrid sharding, MiCS): ZeRO shards over ``shard_ranks`` = dp x cp / replicas ranks (a
    node's) and each gradient shard is all-reduced over the replicas after its reduce-scatter.
    ``etp``: expert tensor parallelism (Megatron-LM's expert-tensor-parallel size): each routed
    expert split over ``etp`` ranks inside ep x etp of the dp ranks, attention data-parallel
    (tp 1; with tp > 1 the experts follow tp, Megatron's default)
    (``labkit.parallel.expert.expert_tensor``).
    ``param_dtype``: "bf16" is ZeRO-3 as FSDP2 runs it under ``MixedPrecisionPolicy(param_dtype=
    torch.bfloat16, reduce_dtype=torch.float32)`` (with the "bf16-master" recipe): the fp32
    shards are the master weights, each block is all-gathered in bf16 and the next one's
    all-gather prefetched; None is labkit's ZeRO-3 (bf16 shards beside fp32 masters, as
    DeepSpeed keeps them, one block gathered at a time). Against fake FSDP2 steps (LLaMA-2-7B,
    Qwen3-8B, LLaMA-3-8B, Gemma; DeepSeek-V2-Lite with its experts split evenly; N up to where
    every tensor's first dimension divides by N; recompute none, full, selective, every-k; pp 1,
    AdamW): to the byte where the peak is at the start of the backward pass, at the root's
    reduce-scatter or at the optimizer step; inside a block's backward a bound up to 7% above.
    The estimate's "assumes" names each case. Refused: pp, recompute "sqrt" (FSDP2 keeps a
    multi-block unit's blocks gathered while it recomputes), HSDP with accumulation.
    """

    dp: int = 1
    zero_stage: int = 0
    tp: int = 1
    sp: bool = False
    pp: int = 1
    micro_batches: int | None = None
    schedule: str = "1f1b"
    virtual_stages: int = 1
    ep: int = 1
    cp: int = 1
    gradient_as_bucket_view: bool = False
    offload: bool = False
    ddp_buckets: bool | None = None
    replicas: int = 1
    etp: int = 1
    param_dtype: str | None = None

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "ep", "cp", "virtual_stages", "replicas", "etp"):
            object.__setattr__(self, name, check_positive(name, getattr(self, name)))
        if self.micro_batches is not None:
            object.__setattr__(self, "micro_batches",
                               check_positive("micro_batches", self.micro_batches))
        if type(self.zero_stage) is not int or self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.offload and not self.zero_stage:
            raise ValueError("offload=True keeps ZeRO's shards in host memory (ZeRO-Offload): "
                             "choose zero_stage 1, 2 or 3")
        if self.gradient_as_bucket_view and self.zero_stage:
            raise ValueError("gradient_as_bucket_view is DDP's option (zero_stage=0); ZeRO "
                             "keeps its own flat gradient buckets")
        if self.gradient_as_bucket_view and self.ddp_buckets is False:
            raise ValueError("gradient_as_bucket_view makes the gradients views of DDP's buckets: "
                             "it needs ddp_buckets=True (or None with ep=1)")
        if self.ep > 1 and self.dp % self.ep:
            raise ValueError(f"ep={self.ep} splits the experts over ep of the dp={self.dp} data-"
                             f"parallel ranks: choose dp among the multiples of {self.ep} (e.g. "
                             f"Layout(dp={self.ep}, ep={self.ep}))")
        if self.sp and self.tp == 1:
            raise ValueError("sequence parallelism (sp=True) splits activations over the tensor-"
                             "parallel group: it needs tp > 1")
        check_choice("schedule", self.schedule, SCHEDULES)
        self._check_replicas()
        self._check_etp()
        self._check_param_dtype()
        if (self.virtual_stages > 1) != (self.schedule == "interleaved"):
            raise ValueError(f"schedule={self.schedule!r} with virtual_stages="
                             f"{self.virtual_stages}: interleaved 1F1B needs virtual_stages >= 2 "
                             "(model chunks per stage), every other schedule 1")
        if self.schedule in V_SCHEDULES and self.pp == 1:
            raise ValueError(f"schedule={self.schedule!r} places two chunks per stage in a V "
                             "over pipeline stages: it needs pp >= 2")
        if self.schedule == "dualpipe-v" and self.micro_batch_count < 2 * self.pp:
            raise ValueError(f"DualPipeV needs micro_batches >= 2 x pp = {2 * self.pp} (torch's "
                             f"ScheduleDualPipeV refuses fewer): choose micro_batches={2 * self.pp}")
        if self.schedule == "interleaved" and self.micro_batch_count % self.pp:
            raise ValueError(f"interleaved 1F1B runs micro-batches in groups of pp={self.pp}: "
                             f"choose micro_batches among the multiples of {self.pp}")

    def _check_replicas(self):
        if self.replicas == 1:
            return
        if not self.zero_stage:
            raise ValueError(f"replicas={self.replicas} replicates ZeRO's shards (HSDP): set "
                             "zero_stage=3 (or 1, 2); plain DDP (zero_stage=0) replicates everything")
        if self.data_ranks % self.replicas or self.data_ranks // self.replicas < 2:
            raise ValueError(f"replicas={self.replicas} must divide dp x cp = {self.data_ranks} "
                             "and leave 2 or more ranks per shard group: choose replicas among "
                             f"the divisors of {self.data_ranks // 2 or 1} (e.g. the nodes)")
        if self.ep > 1 or self.offload:
            raise ValueError("replicas (HSDP) is modelled without expert parallelism and "
                             "without offload: use ep=1, offload=False, or replicas=1")

    def _check_etp(self):
        if self.etp == 1:
            return
        if self.tp > 1:
            raise ValueError(f"etp={self.etp} with tp={self.tp}: labkit models etp > 1 with tp 1 "
                             "only; under tp > 1 the experts are split over tp already (Megatron's "
                             "default, ETP = TP; Megatron also allows ETP != TP): use etp=1, or "
                             "tp=1")
        if self.dp % self.expert_ranks:
            raise ValueError(f"ep x etp = {self.expert_ranks} must divide dp={self.dp}: choose dp "
                             f"among the multiples of {self.expert_ranks}")
        others = {"zero_stage": self.zero_stage, "pp": self.pp - 1, "cp": self.cp - 1,
                  "offload": self.offload, "replicas": self.replicas - 1}
        if any(others.values()):
            raise ValueError("etp is modelled for expert x expert-tensor parallelism inside plain "
                             "data parallelism (what labkit.parallel.expert.expert_tensor runs): "
                             "use zero_stage=0, pp=1, cp=1, offload=False and replicas=1 with it")

    def _check_param_dtype(self):
        if self.param_dtype is None:
            return
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"param_dtype={self.param_dtype!r}: \"bf16\" (FSDP2's "
                             "MixedPrecisionPolicy(param_dtype=torch.bfloat16)) or None")
        if self.zero_stage != 3 or self.ep > 1 or self.etp > 1 or self.offload:
            raise ValueError("param_dtype='bf16' is FSDP2's mixed precision over ZeRO-3 shards: "
                             "set zero_stage=3, and use ep=1, etp=1 and offload=False with it")
        if self.replicas > 1 and self.micro_batch_count > 1:
            raise ValueError("param_dtype='bf16' with replicas and micro_batches > 1: FSDP2's HSDP "
                             "keeps each block's reduced gradient until the backward ends, not "
                             "modelled; use micro_batches=1 or replicas=1")
        if self.pp > 1:
            raise ValueError("param_dtype='bf16' with pp > 1: torch.distributed.pipelining runs "
                             "FSDP2 without gradient sync until the last micro-batch (whole fp32 "
                             "gradients of the stage), not modelled; use pp=1")

    @property
    def expert_ranks(self) -> int:
        """The ranks one copy of the routed experts is split over: ep x etp."""
        return self.ep * self.etp

    @property
    def keeps_ddp_buckets(self) -> bool:
        """``ddp_buckets``, or when None: DDP's buckets for plain data parallelism only."""
        return self.expert_ranks == 1 if self.ddp_buckets is None else self.ddp_buckets

    @property
    def data_ranks(self) -> int:
        """The ranks holding the same weights, whose gradients are averaged: dp x cp. ZeRO shards
        over them, as Megatron-LM's distributed optimizer and torchtitan's FSDP do with context
        parallelism (each cp rank trains on its own tokens, as a dp rank on its own rows)."""
        return self.dp * self.cp

    @property
    def shard_ranks(self) -> int:
        """The ranks ZeRO shards over: dp x cp, or under HSDP a replica's (one node's)."""
        return self.data_ranks // self.replicas

    @property
    def micro_batch_count(self) -> int:
        return self.micro_batches or self.pp

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline stage: ``virtual_stages``, two in a V, else one."""
        return 2 if self.schedule in V_SCHEDULES else self.virtual_stages

    @property
    def placement(self) -> str:
        """"v" (stage s holds chunks s and 2 pp - 1 - s: stage 0 also ends the model) or "loop"."""
        return placement_of(self.schedule)

    def check(self, cfg, seq: int) -> None:
        """ValueError naming the fix when this layout cannot split ``cfg`` at ``seq`` tokens."""
        if cfg.heads % self.tp:
            raise ValueError(f"tp={self.tp} does not divide heads={cfg.heads}; choose tp among "
                             f"the divisors of {cfg.heads}")
        if self.pp > 1 and cfg.tie_embeddings:
            raise ValueError(f"pp={self.pp} with tied embeddings: the first stage's embedding is "
                             "the last stage's LM head, a copy the estimate does not count "
                             "(Megatron-LM keeps one and all-reduces its gradient); use pp=1, "
                             "or untie them (tie_embeddings=False)")
        if self.pp * self.chunks > cfg.layers:
            chunks = ("2 chunks (a V)" if self.placement == "v"
                      else f"virtual_stages={self.virtual_stages}")
            raise ValueError(f"pp={self.pp} x {chunks} is larger than layers={cfg.layers}; a "
                             "pipeline chunk needs at least one layer")
        if self.ep > 1 and (not cfg.is_moe or cfg.routed_experts % self.ep):
            raise ValueError(f"ep={self.ep} must divide the routed experts "
                             f"({cfg.routed_experts}); use ep=1 for a dense model")
        if self.etp > 1 and not cfg.is_moe:
            raise ValueError(f"etp={self.etp}: {cfg.name} is a dense model with no routed experts "
                             "to split; use etp=1")
        if self.etp > 1 and cfg.moe_ffn % self.etp:
            raise ValueError(f"etp={self.etp} splits each routed expert's ffn width "
                             f"({cfg.moe_ffn}) over etp ranks: choose etp among its divisors")
        if seq % (self.cp * (self.tp if self.sp else 1)):
            raise ValueError(f"seq={seq} must be divisible by cp x (tp with sp) = "
                             f"{self.cp * (self.tp if self.sp else 1)}")


def recipe_from(recipe: Recipe | None, **keywords) -> Recipe:
    """The step's Recipe: ``recipe``, or one made of the keywords. A keyword moved from its
    default that the recipe contradicts raises: it would be silently ignored."""
    if recipe is None:
        return Recipe(**keywords)
    default = Recipe()
    clashes = [f"{name}={value!r} (the recipe has {getattr(recipe, name)!r})"
               for name, value in keywords.items()
               if value != getattr(default, name) and value != getattr(recipe, name)]
    if clashes:
        raise ValueError("give the step either as keywords or as recipe=lk.Recipe(...), not "
                         f"both: {', '.join(clashes)}; put them all in the Recipe")
    return recipe


def layout_from(layout: Layout | None, **keywords) -> Layout:
    """The step's Layout: ``layout``, or one made of the keywords (dp=, zero_stage=, ...),
    never both."""
    if layout is None:
        return Layout(**keywords)
    default = Layout()
    moved = [f"{name}={value!r}" for name, value in keywords.items()
             if value != getattr(default, name)]
    if moved:
        raise ValueError(f"give the layout either as keywords ({', '.join(keywords)}) or as "
                         f"layout=lk.Layout(...), not both ({', '.join(moved)}): put them all in "
                         "the Layout")
    return layout

