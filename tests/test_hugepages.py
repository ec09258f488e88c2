"""Huge pages for one process's buffers: asked for per process, never set for the host."""
import pytest

from labkit.host import hugepages

MiB = 2**20


@pytest.mark.parametrize("text, mode", [("always [madvise] never\n", "madvise"),
                                        ("[always] madvise never\n", "always"),
                                        ("always madvise [never]\n", "never")])
def test_thp_mode_is_the_bracketed_word(tmp_path, text, mode):
    path = tmp_path / "enabled"
    path.write_text(text)
    assert hugepages.thp_mode(str(path)) == mode
    assert hugepages.thp_mode(str(tmp_path / "missing")) == "unknown"


@pytest.mark.slow            # a child Python process per call (torch imported): 39 s in CI
def test_pytorch_asks_for_huge_pages_only_when_told_to():
    """Under the kernel's madvise mode THP_MEM_ALLOC_ENABLE=1 backs a 64 MiB tensor with 2 MiB
    pages (all but its unaligned ends) and without it none are; 'always' backs both, 'never'
    neither."""
    mode = hugepages.thp_mode()
    if mode not in ("always", "madvise", "never"):
        pytest.skip(f"no THP on this kernel ({mode})")
    on = hugepages.first_touch(64 * MiB, thp_alloc=True, repeats=1)
    off = hugepages.first_touch(64 * MiB, thp_alloc=False, repeats=1)
    if on.huge_bytes is None:
        pytest.skip("this kernel has no smaps_rollup")
    if mode == "never":
        assert on.huge_bytes == off.huge_bytes == 0
    else:
        assert on.huge_bytes >= 60 * MiB
        assert (off.huge_bytes >= 60 * MiB) == (mode == "always")


def test_first_touch_rejects_bad_sizes():
    with pytest.raises(ValueError, match="nbytes must be a positive integer"):
        hugepages.first_touch(0, thp_alloc=True)


@pytest.mark.slow            # two child processes: 33 s in CI
def test_first_touch_times_the_first_allocation_apart_from_later_ones_and_retouches():
    """Only the first allocation is a first touch: later ones reuse blocks just freed, and a
    retouch writes pages already mapped. Each is reported on its own, none folded into a median."""
    t = hugepages.first_touch(8 * MiB, thp_alloc=False, repeats=3, retouches=2)
    assert t.first > 0 and t.again > 0 and t.retouch > 0
    assert t.gib_per_s == pytest.approx(8 * MiB / t.first / 2**30)
    assert t.compact_stalls is None or t.compact_stalls >= 0
    assert hugepages.first_touch(8 * MiB, thp_alloc=False, repeats=1).again is None
    with pytest.raises(ValueError, match="retouches must be a positive integer"):
        hugepages.first_touch(8 * MiB, thp_alloc=False, retouches=0)
