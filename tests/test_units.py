"""labkit.core.units: the reconciliation table's differences."""
from labkit.core.units import Breakdown, reconciliation


def row(table: str, label: str) -> str:
    return next(line for line in table.splitlines() if line.startswith(label))


def test_a_few_bytes_off_a_tiny_category_are_a_share_of_the_peak():
    measured = Breakdown(params=1 << 30, activations=8)
    predicted = Breakdown(params=1 << 30, activations=8 + 65_536)
    table = reconciliation(predicted, measured)
    assert row(table, "activations").endswith("(+0.01% of the peak)")      # not +819200.00%
    assert row(table, "parameters").endswith("(+0.00%)")
    assert row(table, "total (peak)").endswith("(+0.01%)")


def test_a_category_of_its_own_size_keeps_its_own_percent():
    table = reconciliation(Breakdown(params=110, grads=100), Breakdown(params=100, grads=100))
    assert row(table, "parameters").endswith("(+10.00%)")
    assert row(table, "gradients").endswith("(+0.00%)")
