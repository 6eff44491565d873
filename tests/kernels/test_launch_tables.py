"""Launch tables fetched by the SMs (kernels/launch_tables.py): the values arrive (fresh random 64-bit words, odd
lengths, across the ring's wrap), against the twin; a host region is rewritten only after every fetch that read
it was waited for (and a ring without that wait is caught); a fetch on another stream waits for the last one's."""
import random

import pytest
import torch

from kernels import launch_tables as lt


class _Ev:
    def __init__(self):
        self.synced = False

    def synchronize(self):
        self.synced = True


def test_values_arrive_across_wraps(device):
    t = lt.LaunchTables(device, words=1_000)
    rng = random.Random(7)
    for k in (1, 17, 333, 999, 1_000, 5, 640, 777):
        values = [rng.randrange(-2**63, 2**63) for _ in range(k)]
        got = t.put(values)
        assert got.device.type == torch.device(device).type and got.dtype == torch.int64
        ref = lt.fetch_torch(torch.tensor(values, dtype=torch.int64), torch.empty(k, dtype=torch.int64, device=device))
        assert torch.equal(got.cpu(), ref.cpu())
    assert t.cycle >= 3 and t.put([]).numel() == 0


def test_oversized_table_is_refused(device):
    with pytest.raises(ValueError, match="ring holds 64"):
        lt.LaunchTables(device, words=64).put(list(range(65)))


def _unsafe_rewrites(t: lt.LaunchTables, sizes, seed=3) -> int:
    """Puts of the given sizes; after each, the earlier puts whose host words the new one overwrote and whose fetch
    was not waited for (a fetch could still read them: each would be a wrong table)."""
    events, bad = [], 0
    rng = random.Random(seed)
    for k in sizes:
        t.put([rng.randrange(2**40) for _ in range(k)])
        a, b = t.at - k, t.at
        for (c, s, e), ev in events:
            if s < b and a < e and not ev.synced:
                bad += 1
                ev.synced = True         # counted once
        events.append(((t.cycle, a, b), t.inflight[-1][3]))
    return bad


def test_host_region_rewritten_only_after_its_fetch(device):
    t = lt.LaunchTables(device, words=100, event=_Ev)
    sizes = [30, 30, 30, 25, 40, 7, 60, 33, 33, 33, 99, 1, 50, 50]
    assert _unsafe_rewrites(t, sizes) == 0
    assert t.waited >= 8                # the wraps waited: the test exercised them


def test_must_fail_ring_without_waits(device, monkeypatch):
    monkeypatch.setattr(lt.LaunchTables, "_drain", lambda self, overlaps: None)
    t = lt.LaunchTables(device, words=100, event=_Ev)
    assert _unsafe_rewrites(t, [30, 30, 30, 25, 40, 7, 60, 33, 33, 33, 99, 1, 50, 50]) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams and events need CUDA")
def test_gpu_fetch_on_another_stream_waits_for_the_last():
    t = lt.LaunchTables("cuda", words=4096)
    a = t.put(list(range(4096 - 8)))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        b = t.put([5] * 16)          # wraps onto a's words: after a's fetch, in the other stream's order
        torch.cuda.current_stream().synchronize()
    torch.cuda.synchronize()
    assert b.tolist() == [5] * 16 and a[16:32].tolist() == list(range(16, 32))


@pytest.mark.parametrize("k, rows", [(1, 5), (777, 40), (999, 0)])
def test_a_kernel_of_the_callers_fetches_the_table(device, k, rows):
    """`fetched_by`: the caller's own launch (kernels.expert_prefill_rega.permute_x, whose programs stride over the
    table: 777 words against 2 programs of 256) copies the words into the ring's slice, its own output unchanged,
    the ring's cursor and fetch listed as after `put` (across a wrap). Must fail: the same launch without the table
    leaves the slice as it was."""
    from kernels.expert_prefill_rega import permute_x
    t = lt.LaunchTables(device, words=1_000)
    t.put(list(range(600)))                          # a table of more than 400 words wraps the ring
    a = 600 if 600 + k <= 1_000 else 0
    rng = random.Random(k)
    values = [rng.randrange(-2**63, 2**63) for _ in range(k)]
    x = torch.randn(max(rows, 1), 200, device=device).bfloat16()[:rows]
    with t.fetched_by(values) as (dst, fetch):
        dst.fill_(-1)
        assert fetch[1] == k and all(f[1:3] != (a, a + k) for f in t.inflight)     # not listed before its launch
        out = permute_x(x, table=(dst, fetch))
    assert t.at == a + k and t.inflight[-1][1:3] == (a, a + k) and t.cycle == (a == 0)
    assert dst.cpu().tolist() == values and torch.equal(out, permute_x(x))
    with t.fetched_by(values) as (dst, fetch):
        dst.fill_(-1)
        permute_x(x, table=(dst, None))
    assert dst.cpu().tolist() == [-1] * k
