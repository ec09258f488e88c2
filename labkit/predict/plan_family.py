"""One layout the planner considers: its family (what its model states depend on) and a
candidate (a family's member with a micro-batch, a recompute policy and a schedule)."""
from __future__ import annotations

from dataclasses import dataclass

from labkit.core.recipe import Layout, Recipe
from labkit.predict import Estimate
from labkit.predict.steptime import StepTime

# full: 2 + 2 + 12 B/param (ZeRO's gradient shards fp32: ZeRO-3 (2 + 4 + 12) / N); LoRA: bf16
FULL, ADAPTERS = "bf16-master", "bf16"
OPTIMIZER_LABELS = {"adamw-8bit": ", 8-bit AdamW", "adamw-fused": ", fused AdamW"}


@dataclass(frozen=True)
class Family:
    """What a layout's model states depend on: everything but micro-batch, recompute, schedule."""

    trainable: str
    dp: int
    zero_stage: int
    offload: bool
    tp: int
    pp: int
    ep: int
    cp: int = 1
    optimizer: str = "adamw"
    replicas: int = 1          # HSDP: ZeRO inside each of these groups, replicated across


    @property
    def data_ranks(self) -> int:
        """The ranks ZeRO shards over and gradients are averaged over: dp x cp."""
        return self.dp * self.cp

    @property
    def shard_ranks(self) -> int:
        """The ranks ZeRO shards over: dp x cp, or under HSDP one replica's."""
        return self.data_ranks // self.replicas

    def label(self) -> str:
        what = {"all": "full", "lora": "LoRA", "qlora": "QLoRA"}[self.trainable]
        if self.trainable != "all" and self.zero_stage == 3:
            where = "offloaded to the host" if self.offload else "sharded"
            return f"{what}, frozen base {where} (FSDP2), dp {self.dp}"
        if self.trainable != "all" and self.tp * self.pp * self.ep > 1:
            split = ", ".join(f"{name} {n}" for name, n in
                              (("tp", self.tp), ("pp", self.pp), ("ep", self.ep)) if n > 1)
            return f"{what}, base split by {split}, dp {self.dp}"
        if self.trainable != "all":
            return f"{what}, one GPU per replica, dp {self.dp}"
        zero = f"ZeRO-{self.zero_stage}{'-Offload' if self.offload else ''}"
        if self.offload and self.zero_stage < 3 and self.data_ranks == 1:
            zero = "optimizer offload"              # nothing to shard over one data rank
        if self.zero_stage and self.cp > 1:
            zero += f" over dp x cp = {self.data_ranks}"
        if self.replicas > 1:
            zero += f" inside {self.replicas} replicas of {self.shard_ranks} (HSDP)"
        return (f"{what}, {zero}, dp {self.dp}, tp {self.tp}, pp {self.pp}"
                + (f", ep {self.ep}" if self.ep > 1 else "")
                + (f", cp {self.cp}" if self.cp > 1 else "")
                + OPTIMIZER_LABELS.get(self.optimizer, ""))

    def recipe_fields(self) -> dict:
        """The Recipe's optimizer and implementation (None: CUDA's default, foreach)."""
        if self.optimizer == "adamw-fused":
            return dict(optimizer="adamw", optimizer_impl="fused")
        return dict(optimizer=self.optimizer)


@dataclass
class Candidate:
    """One layout: its family, recipe, micro-batch, per-GPU bytes and modelled step time."""

    family: Family
    layout: Layout
    recipe: Recipe
    micro_batch: int
    micro_batches: int
    time: StepTime
    estimate: Estimate | None = None

    def label(self) -> str:
        sched = (f", {self.layout.schedule}" + (f" v{self.layout.virtual_stages}"
                                                if self.layout.virtual_stages > 1 else "")
                 if self.layout.pp > 1 else "")
        return (f"{self.family.label()}{sched}, mb {self.micro_batch} x {self.micro_batches}, "
                f"recompute {self.recipe.recompute}")

    def as_dict(self) -> dict:
        return {"label": self.label(), "family": self.family.label(),
                "layout": dict(vars(self.layout)), "recipe": dict(vars(self.recipe)),
                "micro_batch": self.micro_batch, "micro_batches": self.micro_batches,
                "time": self.time.as_dict(), "time_dp_overlapped": self.time.dp_overlapped,
                "time_overlapped": self.time.overlapped,
                "memory": self.estimate.as_dict() if self.estimate else None}
