"""The capstone's summary: each technique's saving, recomputed from the estimate in its regime."""
import pytest

import labkit as lk
from labkit.course import plot
from labkit.course.savings import Saving, course_savings


def test_each_technique_saves_in_its_regime_and_the_rows_are_the_estimates():
    rows = course_savings(allocator_steps=False)
    assert [r.lab for r in rows] == ["02", "03", "04", "05", "06", "06", "07"]
    assert all(0 < r.saved < 1 for r in rows)
    pure_bf16 = rows[0]       # every state halves (a few fp32 scalars and softmaxes do not)
    assert abs(pure_bf16.saved - 0.5) < 0.001
    zero3 = rows[2]
    assert zero3.after == lk.estimate("llama-2-7b", 1, 4096, precision="bf16-master",
                                      layout=lk.Layout(dp=8, zero_stage=3)).total


def test_a_technique_that_costs_memory_shows_a_negative_saving():
    assert Saving("x", "00", "here", before=100, after=125).saved == pytest.approx(-0.25)


def test_the_course_savings_figure_has_a_bar_per_technique():
    rows = course_savings(allocator_steps=False)
    fig = plot.course_savings_figure(rows)
    assert len(fig.axes[0].patches) == len(rows)
    with pytest.raises(ValueError, match="nothing to plot"):
        plot.course_savings_figure([])
