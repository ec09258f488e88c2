"""torch's V-shaped pipeline schedules (ZB-V, DualPipeV) as labkit op lists: every op once, on
the V's virtual stages, and their bubble and memory from labkit's simulator."""
from fractions import Fraction

import pytest
from torch.distributed.pipelining.schedules import generate_rank_to_stage_mapping

from labkit.parallel.pipeline.schedules import make_schedule, simulate
from labkit.parallel.pipeline.torch_orders import torch_order, v_schedule

HALF = {kind: Fraction(1, 2) for kind in "FBW"}          # a chunk is half a stage
CASES = [(2, 4), (4, 8), (4, 16), (8, 16), (8, 24)]


@pytest.mark.parametrize("name", ["zb-v", "dualpipe-v"])
def test_each_stage_runs_torchs_ops_on_the_v(name):
    p, m = 4, 8
    schedule = v_schedule(name, p, m)                     # validate(): every op once, in order
    stages_of = generate_rank_to_stage_mapping(p, 2 * p, style="v")
    for s, (actions, ops) in enumerate(zip(torch_order(name, p, m), schedule.stages)):
        assert {schedule.virtual_stage(s, c) for c in (0, 1)} == set(stages_of[s])
        torch_forwards = [(a.stage_index, a.microbatch_index)
                          for act in actions for a in (act.sub_actions or [act])
                          if a.computation_type.value == "F"]
        ours = [(schedule.virtual_stage(s, op.chunk), op.micro_batch) for op in ops
                if op.kind == "F"]
        assert ours == torch_forwards                      # the same order, stage by stage


@pytest.mark.parametrize("p, m", CASES)
def test_v_schedules_idle_only_while_the_first_micro_batch_arrives(p, m):
    """With F = B = W, the last stage waits p - 1 chunk forwards for its first input and then
    never idles: the lower bound (p - 1) / (6m + p - 1), half of ZB-H1's p - 1 stage-sized ops.
    ZB-V holds p micro-batches per stage (2p chunks of half a stage), DualPipeV one chunk more."""
    for name, extra in (("zb-v", 0), ("dualpipe-v", 1)):
        timeline = simulate(v_schedule(name, p, m), HALF)
        assert timeline.idle_fraction == Fraction(p - 1, 6 * m + p - 1)
        assert timeline.held == [2 * p + extra] * p
    zb_h1 = simulate(make_schedule("zb-h1", p, m))
    assert zb_h1.idle_fraction == Fraction(p - 1, 3 * m + p - 1)


def test_bad_choices_are_named():
    with pytest.raises(ValueError, match="at least as many micro-batches as its 8 chunks"):
        v_schedule("dualpipe-v", 4, 6)
    with pytest.raises(ValueError, match="unknown schedule"):
        v_schedule("dualpipe", 4, 8)
