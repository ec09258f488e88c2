"""ipywidgets panels. Thin on purpose: every panel calls plain functions that the tests call.

    from labkit.course import widgets
    widgets.memory_panel()     # pick a model and a step, see the predicted breakdown;
                               # a button measures the same step on fake tensors
    widgets.states_panel()     # lab 01: bytes per parameter of each state, sharded by ZeRO
    widgets.recompute_panel()  # lab 03: a checkpointing policy's memory and recompute cost
    widgets.zero_panel()       # lab 04: ZeRO stage and GPUs -> each rank's memory, measured
    widgets.pipeline_panel()   # lab 05: tp, pp, micro-batches, schedule -> stages, Gantt
    widgets.quant_panel()      # lab 06: scheme, bits, block -> bits per parameter, error
    widgets.attention_panel()  # lab 07: attention core's memory by implementation, KV cache
    widgets.allocator_panel()  # lab 08: what the CUDA caching allocator reserves for a step
    widgets.plan_panel()       # lab 09: the layouts that fit a cluster, fastest first
"""
import ipywidgets as w  # noqa: F401 - ipywidgets, as labkit.course.widgets.w

from labkit.course.panel_reports import (BUBBLE_FORMULAS, GANTT_MAX, INTERLEAVED_CHUNKS,
                                         MAX_MICRO_BATCHES, MAX_PP, MICRO_BATCH, PIPELINE_SEQS,
                                         PLAN_GPU_COUNTS, SHAPE_FIELDS, SHOWN_STAGES, STATES,
                                         PanelResult, PipelineResult, PlanResult, RecomputeResult,
                                         StatesResult, gantt_title, model_config, pipeline_report,
                                         plan_report, recompute_report, states_report, tp_choices)
from labkit.course.widgets.allocator import (ALLOCATORS, ALLOCATOR_MODELS, AllocatorPanel,
                                             AllocatorResult, allocator_panel, allocator_report)
from labkit.course.widgets.attention import (AttentionPanel, AttentionResult, CONTEXT_CURVE,
                                             HBM_GPUS, SEQ_CURVE, attention_panel, attention_report,
                                             mha_cache_bytes)
from labkit.course.widgets.base import controls_spec
from labkit.course.widgets.controls import PANEL_CONTROLS
from labkit.course.widgets.memory import MemoryPanel, memory_panel, predict, predict_and_measure
from labkit.course.widgets.pipeline import PipelinePanel, pipeline_panel
from labkit.course.widgets.planner import PlanPanel, plan_panel
from labkit.course.widgets.quant import (FIXED_BITS, INT8_GRANULARITIES, QUANT_BLOCKS,
                                         QUANT_SCHEMES, QUANT_SWEEP, QuantPanel, QuantResult,
                                         SEVEN_B, WEIGHT_SHAPE, default_weight, quant_inputs,
                                         quant_label, quant_panel, quant_reference, quant_report)
from labkit.course.widgets.recompute import RecomputePanel, recompute_panel
from labkit.course.widgets.states import StatesPanel, states_panel
from labkit.course.widgets.zero import (COURSE_MODELS, GPU_COUNTS, MEASURABLE_GPUS, MEASURE_STEPS,
                                        ZERO_PRECISIONS, ZeroPanel, ZeroResult, why_not_measurable,
                                        zero_panel, zero_report)
from labkit.transformer.attention import attention_core_bytes  # noqa: F401 - lab 07's panel

# each panel function -> the class that holds its state (what the website's live panels build)
PANEL_CLASSES = {"memory_panel": MemoryPanel, "states_panel": StatesPanel,
                 "recompute_panel": RecomputePanel, "zero_panel": ZeroPanel,
                 "pipeline_panel": PipelinePanel, "quant_panel": QuantPanel,
                 "attention_panel": AttentionPanel, "allocator_panel": AllocatorPanel,
                 "plan_panel": PlanPanel}
