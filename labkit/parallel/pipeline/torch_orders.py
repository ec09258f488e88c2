"""The V-shaped schedules torch ships, as labkit ``Schedule``s: torch.distributed.pipelining's
own order for each stage, turned into op lists that ``schedules.simulate`` times and counts.

    ``zb-v``        ScheduleZBVZeroBubble (the Zero Bubble paper's ZB-V): B / W split
    ``dualpipe-v``  ScheduleDualPipeV (DeepSeek-V3's DualPipe cut in half, after Sea AI Lab)

Each stage holds two chunks in a V (virtual stages s and 2p - 1 - s), so the first stage also
computes the last chunk and the loss. torch's full backward becomes B then W. DualPipeV's
overlapped pairs (one chunk's forward beside another's backward) run their halves one after the
other, as torch 2.13's runtime does unless an overlap function is registered
(``register_custom_function(OVERLAP_F_B, ...)``). An action that becomes several ops (a pair, a
full backward) is one of the Schedule's ``groups``: torch posts its sends after the whole action
(``_add_send_recv``), so ``schedules.simulate`` lets its outputs leave at the action's end. That
is DeepSeek's rule too: without communication to hide, DualPipeV idles as ZB-H1 does
(``schedules.dualpipe_bubble``).
"""
from __future__ import annotations

from types import SimpleNamespace

from labkit.core.units import check_choice, check_positive
from labkit.parallel.pipeline.schedules import Op, Schedule, validate

TORCH_SCHEDULES = {"zb-v": "ScheduleZBVZeroBubble", "dualpipe-v": "ScheduleDualPipeV"}


def torch_order(name: str, p: int, m: int) -> list[list]:
    """Per stage, torch's list of actions (``_Action``: stage index, kind, micro-batch, and the
    sub-actions of an overlapped pair), as its schedule class computes them for every rank."""
    from torch.distributed.pipelining import schedules as torch_schedules

    check_choice("schedule", name, TORCH_SCHEDULES)
    check_positive("p", p)
    check_positive("m", m)
    if name == "dualpipe-v" and m < 2 * p:
        raise ValueError(f"DualPipeV needs at least as many micro-batches as its {2 * p} chunks "
                         f"(2 per stage); got m={m}")
    cls = getattr(torch_schedules, TORCH_SCHEDULES[name])
    # what the class reads when it builds the order (it needs no process group for that)
    state = SimpleNamespace(pp_group_size=p, num_stages=2 * p, _n_microbatches=m)
    return [[a for a in cls._calculate_single_rank_operations(state, s) if a is not None]
            for s in range(p)]


def _ops(action, stage: int) -> list[Op]:
    """labkit's ops for one torch action on ``stage``: chunk 0 going down, 1 coming back."""
    if action.sub_actions:                       # an overlapped forward + backward pair
        return [op for sub in action.sub_actions for op in _ops(sub, stage)]
    chunk = 0 if action.stage_index == stage else 1
    kind = action.computation_type.value         # F, I (input grad), W, B (full backward)
    j = action.microbatch_index
    return {"F": [Op("F", j, chunk)], "I": [Op("B", j, chunk)], "W": [Op("W", j, chunk)],
            "B": [Op("B", j, chunk), Op("W", j, chunk)]}[kind]


def v_schedule(name: str, p: int, m: int) -> Schedule:
    """torch's ZB-V or DualPipeV order for p stages and m micro-batches, checked; an action
    that becomes several ops (a full backward, an overlapped pair) is one of ``groups``."""
    stages, groups = [], []
    for s, actions in enumerate(torch_order(name, p, m)):
        ops, ranges = [], []
        for action in actions:
            new = _ops(action, s)
            if len(new) > 1:
                ranges.append((len(ops), len(ops) + len(new)))
            ops += new
        stages.append(tuple(ops))
        groups.append(tuple(ranges))
    schedule = Schedule(name, p, m, 2, tuple(stages), placement="v", groups=tuple(groups))
    validate(schedule)
    return schedule
