"""The copies ahead wait for the kernels that read their slots last: once per launch (the slots a launch read share
its event), never skipping a launch's event, and after the layer's own staging copies (`AheadSlots._put`)."""
from __future__ import annotations

from gpu_worker import slab_copies
from gpu_worker.slab_copies import AheadSlots


class _Stream:
    def __init__(self):
        self.waits = []

    def wait_event(self, ev):
        self.waits.append(ev)


def _slots(free, put=None):
    a = AheadSlots.__new__(AheadSlots)
    a.cuda, a.stream, a.free = True, _Stream(), list(free)
    a._copy_runs = lambda rs, sources: None
    if put is not None:
        a._put = put.__get__(a)
    return a


def test_each_launch_event_waited_once_in_order(monkeypatch):
    monkeypatch.setattr(slab_copies, "ahead_runs", lambda: True)
    after, e1, e2, e3 = object(), object(), object(), object()
    a = _slots([e1, e1, None, e2, e2, e1, e3, e3])       # interleaved: a launch's slots need not be adjacent
    a._put(list(range(8)), list(range(100, 108)), after, None, "copies ahead")
    assert a.stream.waits == [after, e1, e2, e3]


def test_must_fail_a_wait_for_the_first_launch_only_is_caught(monkeypatch):
    """The twin: a put that waits only for the first slot's event would let the copies overwrite slots that later
    launches still read; the equality above catches it."""
    monkeypatch.setattr(slab_copies, "ahead_runs", lambda: True)

    def first_only(self, rs, sources, after, events, what):
        self.stream.wait_event(after)
        first = next((self.free[r] for r in rs if self.free[r] is not None), None)
        if first is not None:
            self.stream.wait_event(first)

    after, e1, e2 = object(), object(), object()
    a = _slots([e1, e2, e1], put=first_only)
    a._put([0, 1, 2], [7, 8, 9], after, None, "copies ahead")
    assert a.stream.waits != [after, e1, e2]
