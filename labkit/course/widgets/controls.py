"""The panels' main controls, for the browser test."""
from __future__ import annotations





# panel function -> the description of a dropdown (and the option to pick) and of a slider that
# change what it shows. tests/browser finds a lab's panel by its call (``memory_panel(``) in the
# notebook, moves these two controls in JupyterLab and checks that the panel's text or figure
# changed. The option matters: at batch 1 the optimizer step sets the peak, so bf16-mixed and
# fp32 show the same bytes (lab 02's point); pure bf16 halves every state.
PANEL_CONTROLS = {
    "memory_panel": {"dropdown": "precision", "option": "bf16", "slider": "seq"},
    "states_panel": {"dropdown": "optimizer", "slider": "ZeRO stage"},
    "recompute_panel": {"dropdown": "policy", "slider": "layers"},
    "zero_panel": {"dropdown": "precision", "option": "fp32", "slider": "ZeRO stage"},
    "pipeline_panel": {"dropdown": "schedule", "option": "zb-h1", "slider": "pp"},
    "quant_panel": {"dropdown": "scheme", "option": "rtn", "slider": "bits"},
    "attention_panel": {"dropdown": "implementation", "option": "naive", "slider": "seq"},
    "allocator_panel": {"dropdown": "allocator", "option": "expandable segments",
                        "slider": "batch"},
    "plan_panel": {"dropdown": "GPU", "option": "h100-80gb", "slider": "seq"},
}
