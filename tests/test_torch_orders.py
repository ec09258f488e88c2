"""torch's V-shaped pipeline schedules (ZB-V, DualPipeV) as labkit op lists: every op once, on
the V's virtual stages, and their bubble and memory from labkit's simulator."""
from dataclasses import replace
from fractions import Fraction

import pytest
from torch.distributed.pipelining.schedules import generate_rank_to_stage_mapping

from labkit.parallel.pipeline.schedules import (Op, Schedule, dualpipe_bubble, make_schedule,
                                                simulate)
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
        kinds = {"F": "F", "I": "B", "W": "W", "B": "BW"}     # torch's full backward: B then W
        theirs = [(kind, a.stage_index, a.microbatch_index)
                  for act in actions for a in (act.sub_actions or [act])
                  for kind in kinds[a.computation_type.value]]
        ours = [(op.kind, schedule.virtual_stage(s, op.chunk), op.micro_batch) for op in ops]
        assert ours == theirs                              # the same ops in the same order


@pytest.mark.parametrize("p, m", CASES)
def test_v_schedules_idle_p_minus_1_chunk_ops_per_stage(p, m):
    """With F = B = W and m >= 2p, ZB-V's stages each idle p - 1 chunk-sized ops in all (the
    last stage's wait for its first input is the least any can idle): (p - 1) / (6m + p - 1),
    about half of ZB-H1's p - 1 stage-sized ops. DualPipeV's overlapped pairs send both halves'
    outputs after the pair, in torch's runtime (``_add_send_recv``) as in DeepSeek's: the next
    stage waits for the whole pair, and it idles as ZB-H1 does, DeepSeek's formula with nothing
    hidden. ZB-V holds p micro-batches per stage (2p chunks of half a stage), DualPipeV one
    chunk more."""
    zb_h1 = simulate(make_schedule("zb-h1", p, m))
    assert zb_h1.idle_fraction == Fraction(p - 1, 3 * m + p - 1)
    for name, extra, idle in (("zb-v", 0, Fraction(p - 1, 6 * m + p - 1)),
                              ("dualpipe-v", 1, zb_h1.idle_fraction)):
        timeline = simulate(v_schedule(name, p, m), HALF)
        assert timeline.idle_fraction == idle, name
        assert timeline.held == [2 * p + extra] * p
    assert dualpipe_bubble(p, m) == pytest.approx(zb_h1.idle_fraction)   # chunk F 1, B 2, W 1


def test_a_pairs_outputs_leave_with_the_pair():
    """An action run as several ops (torch's full backward, an overlapped pair) publishes its
    outputs at its end: a stage waiting on the first half waits for the whole action."""
    ops = (Op("F", 0), Op("B", 0), Op("W", 0))
    two = Schedule("toy", 2, 1, 1, (ops, ops))
    grouped = replace(two, groups=(((1, 3),), ()))         # stage 0's B and W as one action
    assert [span.end for span in simulate(two).stages[0]] == [1, 4, 5]
    assert [span.end for span in simulate(grouped).stages[0]] == [1, 4, 5]   # its own W waits not
    late = replace(two, groups=((), ((1, 3),)))             # stage 1's B leaves after its W
    assert simulate(late).stages[0][1].start == simulate(two).stages[0][1].start + 1


def test_below_2p_micro_batches_the_v_idles_more():
    assert simulate(v_schedule("zb-v", 4, 4), HALF).idle_fraction == Fraction(1, 5)


def test_bad_choices_are_named():
    with pytest.raises(ValueError, match="at least as many micro-batches as its 8 chunks"):
        v_schedule("dualpipe-v", 4, 6)
    with pytest.raises(ValueError, match="unknown schedule"):
        v_schedule("dualpipe", 4, 8)


# ---- what the estimate and the planner take from them (torch-free closed forms) ----------------
def _pending(schedule) -> list[Fraction]:
    """Per stage, the most micro-batches (of the stage's layers) with B run and W not yet."""
    out = []
    for ops in schedule.stages:
        live = most = 0
        for op in ops:
            live += (op.kind == "B") - (op.kind == "W")
            most = max(most, live)
        out.append(Fraction(most, schedule.v))
    return out


@pytest.mark.parametrize("name", ["zb-v", "dualpipe-v"])
def test_the_estimates_closed_forms_are_torchs_orders(name):
    """in_flight, pending_w and pipeline_bubble for every (p, m) torch builds, p up to 8."""
    from labkit.parallel.pipeline.schedules import in_flight, pending_w
    from labkit.predict.papers import pipeline_bubble
    for p in (2, 3, 4, 6, 8):
        for m in range(2 * p if name == "dualpipe-v" else 1, 3 * p + 1):
            schedule = v_schedule(name, p, m)
            assert [in_flight(s, p, m, name) for s in range(p)] == [
                Fraction(h, 2) for h in schedule.peak_held()], (p, m)
            bound, exact = [pending_w(s, p, m, name) for s in range(p)], _pending(schedule)
            if name == "zb-v" and p < m < 2 * p - 1:      # torch defers fewer W's: a bound
                assert all(b >= e for b, e in zip(bound, exact)), (p, m)
            else:
                assert bound == exact, (p, m)
            if m >= 2 * p:
                assert pipeline_bubble(p, m, name) == pytest.approx(
                    float(simulate(schedule, HALF).idle_fraction)), (p, m)
    with pytest.raises(ValueError, match="simulate torch's order"):
        pipeline_bubble(4, 7, name)
