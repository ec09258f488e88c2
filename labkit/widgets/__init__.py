"""ipywidgets panels. Thin on purpose: every panel calls plain functions that the tests call.

    lk.widgets.memory_panel()     # pick a model and a step, see the predicted breakdown;
                                  # a button measures the same step on fake tensors
    lk.widgets.states_panel()     # lab 01: bytes per parameter of each state, sharded by ZeRO
    lk.widgets.recompute_panel()  # lab 03: a checkpointing policy's memory and recompute cost
    lk.widgets.zero_panel()       # lab 04: ZeRO stage and GPUs -> each rank's memory, measured
    lk.widgets.pipeline_panel()   # lab 05: tp, pp, micro-batches, schedule -> stages, Gantt
    lk.widgets.quant_panel()      # lab 06: scheme, bits, block -> bits per parameter, error
    lk.widgets.attention_panel()  # lab 07: attention core's memory by implementation, KV cache
    lk.widgets.allocator_panel()  # lab 08: what the CUDA caching allocator reserves for a step
    lk.widgets.plan_panel()       # lab 09: the layouts that fit a cluster, fastest first
"""
import ipywidgets as w  # noqa: F401 - ipywidgets, as labkit.widgets.w

from ..attention import attention_core_bytes  # noqa: F401 - lab 07's panel counts with it
from .base import PanelResult, SHAPE_FIELDS, model_config
from .memory import MemoryPanel, memory_panel, predict, predict_and_measure
from .states import STATES, StatesPanel, StatesResult, states_panel, states_report
from .recompute import RecomputePanel, recompute_panel, recompute_report
from .zero import (COURSE_MODELS, GPU_COUNTS, MEASURABLE_GPUS, MEASURE_STEPS, ZERO_PRECISIONS,
    ZeroPanel, ZeroResult, why_not_measurable, zero_panel, zero_report)
from .pipeline import (BUBBLE_FORMULAS, GANTT_MAX, INTERLEAVED_CHUNKS, MAX_MICRO_BATCHES, MAX_PP,
    MICRO_BATCH, PIPELINE_SEQS, PipelinePanel, PipelineResult, SHOWN_STAGES, pipeline_panel,
    pipeline_report, tp_choices)
from .quant import (FIXED_BITS, INT8_GRANULARITIES, QUANT_BLOCKS, QUANT_SCHEMES, QUANT_SWEEP,
    QuantPanel, QuantResult, SEVEN_B, WEIGHT_SHAPE, default_weight, quant_inputs, quant_label,
    quant_panel, quant_reference, quant_report)
from .attention import (AttentionPanel, AttentionResult, CONTEXT_CURVE, HBM_GPUS, SEQ_CURVE,
    attention_panel, attention_report, mha_cache_bytes)
from .allocator import (ALLOCATORS, ALLOCATOR_MODELS, AllocatorPanel, AllocatorResult,
    allocator_panel, allocator_report)
from .planner import PLAN_GPU_COUNTS, PlanPanel, PlanResult, plan_panel, plan_report
from .controls import PANEL_CONTROLS
