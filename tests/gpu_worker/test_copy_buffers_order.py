"""A copy stream's new device buffer is written only after the compute stream's queued work (gpu_worker/slab_copies.py
`StagingRing`, `AheadSlots`). The caching allocator hands a buffer allocated on the compute stream memory that a
tensor freed a moment ago still holds for kernels queued there; a copy stream that does not wait for the compute
stream overwrites it under them. CUDA only: a busy compute stream (`torch.cuda._sleep`) with a reader of the freed
tensor queued behind it, then the buffer made and filled; the reader must see the old bytes. The twin (the copy
stream's wait removed) shows the test catches the race wherever the allocator reuses the block."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.slab_copies import SlabRows, AheadSlots, StagingRing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="copy streams and the caching allocator: CUDA")

N, STRIDE = 4, 1 << 20


def _fill(kind, dev, slab):
    if kind == "ring":
        buf = StagingRing(N, STRIDE, STRIDE, dev, SlabRows(slab))
        buf.stage(list(range(N)))
    else:
        buf = AheadSlots(N, STRIDE, STRIDE, dev, True, SlabRows(slab))
        buf.copy(0, list(range(N)), list(range(N)), [0] * N)
    return buf


def _race(kind, monkeypatch=None):
    """(the reader's bytes equal the freed tensor's, the new buffer took the freed tensor's memory)."""
    dev = torch.device("cuda")
    x = torch.randint(0, 255, (N, STRIDE), dtype=torch.uint8, device=dev)
    want = x.clone()
    src = torch.full((N, STRIDE), 7, dtype=torch.uint8).pin_memory()      # the slab
    torch.cuda.synchronize()
    torch.cuda._sleep(300_000_000)          # the compute stream busy for a while (~0.2 s on an H200)
    y = x.clone()                           # a reader of x's memory, queued behind it
    ptr = x.data_ptr()
    del x                                   # its block is free for the compute stream's next allocation at once
    if monkeypatch is not None:
        monkeypatch.setattr(torch.cuda.Stream, "wait_stream", lambda self, other: None)
    buf = _fill(kind, dev, src)
    torch.cuda.synchronize()
    return torch.equal(y, want), buf.buf.data_ptr() == ptr


@pytest.mark.parametrize("kind", ["ring", "ahead"])
def test_a_new_buffer_is_written_after_the_compute_streams_readers(kind):
    ok, _ = _race(kind)
    assert ok, f"the {kind} buffer's first copies overwrote memory that a queued kernel still read"


@pytest.mark.parametrize("kind", ["ring", "ahead"])
def test_twin_without_the_wait_is_caught(kind, monkeypatch):
    ok, reused = _race(kind, monkeypatch)
    if not reused:
        pytest.skip("the allocator gave the buffer other memory: no race to show")
    assert not ok, "the twin without the wait was not caught: the test would not see the race"
