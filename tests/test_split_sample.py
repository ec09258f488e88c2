"""Claim 12: the article's SplitModel + DDP sample holds the whole model on every rank; split
over two ranks, each holds its part and the gradients equal one process's."""
import pytest
import torch

from labkit.parallel import cluster
from labkit.parallel.pipeline.split_sample import as_written, one_process, split_over_ranks

WHOLE = (1024 * 512 + 512 + 512 * 256 + 256) * 4       # bytes of both layers, fp32


def test_the_sample_as_written_is_data_parallel():
    ref = one_process()
    for r in cluster.run(as_written, 2):
        assert r.param_bytes == WHOLE and len(r.params) == 4
        for name, g in r.grads.items():            # same rows on both ranks: DDP's mean = one
            torch.testing.assert_close(g, ref.grads[name])


def test_split_over_two_ranks_holds_each_part_once_and_trains_the_same():
    ref = one_process()
    first, second = cluster.run(split_over_ranks, 2)
    assert first.params == ["part1.bias", "part1.weight"]
    assert second.params == ["part2.bias", "part2.weight"]
    assert first.param_bytes + second.param_bytes == WHOLE
    assert second.loss == pytest.approx(ref.loss, rel=1e-6)
    for r in (first, second):
        for name, g in r.grads.items():
            torch.testing.assert_close(g, ref.grads[name])


def test_split_needs_two_ranks():
    with pytest.raises(Exception, match="2 ranks"):
        cluster.run(split_over_ranks, 1)
