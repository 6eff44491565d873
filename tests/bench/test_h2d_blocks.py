"""bench.h2d_blocks' probe pattern: whole launches of adjacent slots, cut where a registration ends (the driver refuses
a copy that spans two: the first GPU run of this bench hit it, session 11 call 3). Twin: the uncut runs cross."""
from bench.h2d_blocks import _cut


def _ok(runs, chunk):
    return all(s // chunk == (s + k - 1) // chunk for s, k in runs)


def test_runs_cover_the_slots_inside_one_registration_each():
    for s, k, chunk in ((340, 29, 346), (0, 29, 346), (345, 1, 346), (10, 700, 346)):
        runs = _cut(s, k, chunk)
        assert [x for a, n in runs for x in range(a, a + n)] == list(range(s, s + k))
        assert _ok(runs, chunk), runs
    assert not _ok([(340, 29)], 346)        # the twin: one run across the end
