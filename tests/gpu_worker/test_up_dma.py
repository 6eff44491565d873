"""The chosen experts' ups by the copy engine while the fused kernel runs (gpu_worker/up_dma.py): the kernel's
programs read an expert's up rows from the ring only once its batch's flag holds the batch's epoch. CPU (copies
synchronous, the kernel under Triton's interpreter) and CUDA (the copies held back behind a busy copy stream, so a
kernel that does not wait reads the ring's stale bytes: the must-fail twin)."""
import sys
import zlib
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))     # the kernels' shared expert cases
from expert_cases import TOL, experts  # noqa: E402

from gpu_worker.up_dma import (ChosenUpDMA, dma_limit_from_env, stage_after_from_env,  # noqa: E402
                               stage_batch_from_env, stage_extra_from_env, stage_flag_from_env,
                               stage_gate_at_from_env, stage_gate_from_env, stage_min_precision_from_env)
from kernels.expert_layer import expert_layer, expert_layer_torch  # noqa: E402
from kernels.moe_ops import block_addresses  # noqa: E402
from kernels.testing import assert_close, rel_err  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))      # fresh per test, reproducible
SMALL = dict(BLOCK_N=32, BLOCK_K=32, BLOCK_L=32)


def _case(k=5, L=48, I=80):
    geom, blocks, ug, dg, *_ = experts(k=k, L=L, I=I, device=DEVICE)
    x = (torch.randn(L, device=DEVICE).abs() + 0.1).bfloat16()
    return geom, blocks, ug, dg, x, torch.rand(k, device=DEVICE) + 0.1


def _waits(want, flag, order):
    return torch.tensor([want, flag, order], dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_dma_ups_give_the_twin(batch):
    """Some positions' ups copied into the ring (in batches, a flag each), the rest read from the blocks: the twin's
    result. The blocks' own up sections of the copied positions are overwritten, so only the ring gives it."""
    geom, blocks, ug, dg, x, w = _case()
    ref = expert_layer_torch(x, blocks, geom, ug, dg, w)
    k = len(blocks)
    dma = ChosenUpDMA(k, geom.down_off, DEVICE, batch=batch)
    pos = [0, 2, 3]
    saved = [blocks[p].clone() for p in range(k)]
    ups, want, flag, order = dma.copy(pos, [saved[p].data_ptr() for p in pos])
    assert order == [0, 2, 3, 1, 4]       # the experts that wait in copy order, then those read from the slab
    broken = [b.clone() for b in saved]
    for p in pos:
        broken[p][: geom.down_off] = 0x77
    addrs = block_addresses(broken, DEVICE)
    up = torch.tensor([ups[p] if p in pos else addrs[p].item() for p in range(k)], dtype=torch.int64, device=DEVICE)
    out = expert_layer(x, addrs, geom, ug, dg, w, config=SMALL, up_addrs=up, up_ready=(_waits(want, flag, order), dma.flags))
    assert_close(out, ref, TOL, "ups by DMA")
    assert all(want[p] == 0 for p in range(k) if p not in pos) and all(want[p] > 0 for p in pos)
    assert len({want[p] for p in pos}) == -(-len(pos) // batch)      # one epoch per batch
    # twin: the same route, but the ring's slot of position 2 holds position 0's up (a copy to the wrong slot)
    dma.buf[2].copy_(dma.buf[0])
    bad = expert_layer(x, addrs, geom, ug, dg, w, config=SMALL, up_addrs=up, up_ready=(_waits(want, flag, order), dma.flags))
    assert rel_err(bad, ref) > 0.05


def test_plan_orders_the_launch_and_numbers_the_batches():
    """Staged experts first, then the ones that wait, in copy order, then those read from the slab; one epoch and one
    flag (the batch's first slot) per batch, fresh epochs every plan (a flag left from the last layer never matches)."""
    dma = ChosenUpDMA(6, 64, DEVICE, batch=2)
    ups, want, flag, order = dma.plan([1, 2, 5], first=[4])
    assert order == [4, 1, 2, 5, 0, 3]
    assert want[1] == want[2] != want[5] and want[0] == want[3] == want[4] == 0
    assert flag[1] == flag[2] == 1 and flag[5] == 5
    assert ups[1] == dma.buf[1].data_ptr() and ups[0] == 0
    again = dma.plan([1, 2, 5])[1]
    assert min(w for w in again if w) > max(want)


def test_bad_waits_are_named():
    geom, blocks, ug, dg, x, w = _case(k=3)
    addrs = block_addresses(blocks, DEVICE)
    flags = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="up_ready must be"):
        expert_layer(x, addrs, geom, ug, dg, w, up_ready=(torch.zeros(2, 2, dtype=torch.int64, device=DEVICE), flags))
    with pytest.raises(ValueError, match="up_ready must be"):
        expert_layer(x, addrs, geom, ug, dg, w, up_ready=(torch.zeros(3, 3, dtype=torch.int32, device=DEVICE), flags))
    with pytest.raises(ValueError, match="up_ready must be"):        # no room for the give-up counter
        expert_layer(x, addrs, geom, ug, dg, w, up_ready=(torch.zeros(3, 3, dtype=torch.int64, device=DEVICE), flags[:3]))


def test_a_flag_that_never_comes_is_counted_not_waited_for_forever():
    """A wait whose flag never gets its epoch (a bug in the copies' plan) ends after the spin limit and is counted in
    flags[k] (the engine raises on it) instead of hanging the device. Twin: the same wait with the flag set counts
    nothing."""
    geom, blocks, ug, dg, x, w = _case(k=3)
    addrs = block_addresses(blocks, DEVICE)
    for flag_set, gave_up in ((False, 5), (True, 0)):       # 5: expert 1's programs (80 neurons, 16 a program)
        dma = ChosenUpDMA(3, geom.down_off, DEVICE)
        if flag_set:
            dma.flags[1] = 7
        waits = _waits([0, 7, 0], [0, 1, 0], [0, 2, 1])
        cfg = dict(BLOCK_N=16, BLOCK_K=32, BLOCK_L=64, SPIN_LIMIT=3)
        expert_layer(x, addrs, geom, ug, dg, w, config=cfg, up_ready=(waits, dma.flags))
        assert dma.gave_up() == gave_up


def test_limit_from_env(monkeypatch):
    monkeypatch.setenv("MOESTREAM_UP_DMA", "8")
    assert dma_limit_from_env() == 8
    monkeypatch.delenv("MOESTREAM_UP_DMA")
    assert dma_limit_from_env() == 0
    for bad in ("x", "-1"):
        monkeypatch.setenv("MOESTREAM_UP_DMA", bad)
        with pytest.raises(ValueError, match="MOESTREAM_UP_DMA"):
            dma_limit_from_env()


def test_stage_extra_from_env(monkeypatch):
    """3 by default since session 8's H200 run; 0 turns the non-blocking staging off; bad values are named."""
    monkeypatch.delenv("MOESTREAM_STAGE_EXTRA", raising=False)
    assert stage_extra_from_env() == 3
    monkeypatch.setenv("MOESTREAM_STAGE_EXTRA", "0")
    assert stage_extra_from_env() == 0
    for bad in ("three", "-2"):
        monkeypatch.setenv("MOESTREAM_STAGE_EXTRA", bad)
        with pytest.raises(ValueError, match="MOESTREAM_STAGE_EXTRA"):
            stage_extra_from_env()


def test_stage_min_precision_from_env(monkeypatch):
    """0.5 by default (session 18's A/B); 0 turns the gate off; a share within 0 and 1; bad values are named."""
    monkeypatch.delenv("MOESTREAM_STAGE_MIN_PRECISION", raising=False)
    assert stage_min_precision_from_env() == 0.5
    monkeypatch.setenv("MOESTREAM_STAGE_MIN_PRECISION", "0")
    assert stage_min_precision_from_env() == 0.0
    monkeypatch.setenv("MOESTREAM_STAGE_MIN_PRECISION", "0.55")
    assert stage_min_precision_from_env() == 0.55
    for bad in ("half", "-0.1", "1.5"):
        monkeypatch.setenv("MOESTREAM_STAGE_MIN_PRECISION", bad)
        with pytest.raises(ValueError, match="MOESTREAM_STAGE_MIN_PRECISION"):
            stage_min_precision_from_env()


def test_stage_batch_and_flag_from_env(monkeypatch):
    """Staged ups per flag (2 by default, at least 1) and how the flag is set ("write" by default, or "copy"); bad
    values are named."""
    for name in ("MOESTREAM_STAGE_BATCH", "MOESTREAM_STAGE_FLAG"):
        monkeypatch.delenv(name, raising=False)
    assert stage_batch_from_env() == 2 and stage_flag_from_env() == "write"
    monkeypatch.setenv("MOESTREAM_STAGE_BATCH", "1")
    monkeypatch.setenv("MOESTREAM_STAGE_FLAG", "copy")
    assert stage_batch_from_env() == 1 and stage_flag_from_env() == "copy"
    for name, bad in (("MOESTREAM_STAGE_BATCH", "0"), ("MOESTREAM_STAGE_BATCH", "two"),
                      ("MOESTREAM_STAGE_FLAG", "dma")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            stage_batch_from_env() if name.endswith("BATCH") else stage_flag_from_env()
        monkeypatch.delenv(name)


def test_stage_after_gate_and_share_from_env(monkeypatch):
    """How the staged copies follow the expert kernel ("event" by default, "value" or "progress"), whether the kernel
    has the progress gate (on by default) and at what share of its programs it opens (0.9 by default, in (0, 1]);
    bad values are named."""
    for name in ("MOESTREAM_STAGE_AFTER", "MOESTREAM_STAGE_GATE", "MOESTREAM_STAGE_GATE_AT"):
        monkeypatch.delenv(name, raising=False)
    assert (stage_after_from_env(), stage_gate_from_env(), stage_gate_at_from_env()) == ("progress", True, 0.9)
    monkeypatch.setenv("MOESTREAM_STAGE_AFTER", "event")
    monkeypatch.setenv("MOESTREAM_STAGE_GATE", "0")
    monkeypatch.setenv("MOESTREAM_STAGE_GATE_AT", "1")
    assert (stage_after_from_env(), stage_gate_from_env(), stage_gate_at_from_env()) == ("event", False, 1.0)
    for name, bad, read in (("MOESTREAM_STAGE_AFTER", "never", stage_after_from_env),
                            ("MOESTREAM_STAGE_GATE", "yes", stage_gate_from_env),
                            ("MOESTREAM_STAGE_GATE_AT", "0", stage_gate_at_from_env),
                            ("MOESTREAM_STAGE_GATE_AT", "1.5", stage_gate_at_from_env),
                            ("MOESTREAM_STAGE_GATE_AT", "most", stage_gate_at_from_env)):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            read()
        monkeypatch.delenv(name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the staging stream against a running kernel: CUDA")
@pytest.mark.parametrize("after", ["event", "value", "never"])
def test_gpu_staged_copies_wait_for_the_buffers_last_reader(after):
    """A stage's copies start only once the work queued before it on the compute stream is done (the kernel that last
    read the buffer, here a sleep and then a read), whether they follow it by an event or by a stream memory write
    and wait; two stages in a row pass the gate each time. Must-fail twin ("never": the gate dropped): the copies
    overwrite the buffer while its reader still waits to read it."""
    from gpu_worker.up_staging import UpStaging
    n, ub = 3, 4096
    ups = UpStaging(n, ub, DEVICE)
    ups.after = "event" if after == "never" else after
    if after == "never":
        ups._follow_compute = lambda launch_epoch=None: None
    src = [torch.randint(0, 256, (ub,), dtype=torch.uint8).pin_memory() for _ in range(2 * n)]
    old = torch.randint(0, 256, ups.buf.shape, dtype=torch.uint8, device=DEVICE)
    for rnd in range(2):
        ups.buf.copy_(old)
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)        # the buffer's last reader, still running when the copies are queued
        seen = ups.buf.clone()
        ups.stage(rnd, list(range(n)), [t.data_ptr() for t in src[rnd * n:(rnd + 1) * n]], [])
        torch.cuda.synchronize()
        new = torch.stack(src[rnd * n:(rnd + 1) * n]).to(DEVICE)
        assert torch.equal(ups.buf[:, :ub], new), "the copies did not land"
        if after == "never":
            assert not torch.equal(seen, old), "the reader saw the old bytes without a gate: the test shows nothing"
        else:
            assert torch.equal(seen, old), f"the copies overwrote the buffer before its reader ({after})"
    if after == "value":
        assert ups._gate_epoch == 2 and ups.gate[1].item() == 2


@pytest.mark.parametrize("gate", [0.5, 0.0])
def test_extras_stop_at_the_first_rank_seldom_read(gate):
    """With a minimum precision the extras beyond a layer's limit run on only through ranks read at least that share
    of their copies (or copied too few times to tell). Twin (gate 0): every extra is staged."""
    from gpu_worker.up_staging import PRECISION_SAMPLES, UpStaging
    ups = UpStaging(8, 64, "cpu")
    ups.extra, ups.min_precision = 3, gate
    ups.limit[2] = 3
    ups.staged_by_rank = [100] * 5 + [PRECISION_SAMPLES - 1] * 3
    ups._used_by_rank = [95, 90, 80, 70, 30, 0, 0, 0]         # rank 3 read 0.70, rank 4 0.30
    assert ups.how_many(2) == (3 + 1 if gate else 3 + 3)
    ups.limit[2] = 5                                            # the next ranks: too few copies to tell, staged
    assert ups.how_many(2) == 8
    ups.limit[2] = 7                                            # the buffer's end bounds the extras
    assert ups.how_many(2) == 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy engine against a running kernel: CUDA")
@pytest.mark.parametrize("waits", [True, False])
def test_gpu_kernel_waits_for_copies_still_running(waits):
    """The ring's copies held back (the copy stream first sleeps ~20 ms on the GPU) while the kernel is launched at
    once on the compute stream: the waiting kernel gives the twin's result; the must-fail twin (the same kernel
    reading the ring without waiting for the flags) reads the ring's stale zeros and is caught."""
    geom, blocks, ug, dg, x, w = _case(k=6, L=64, I=112)
    ref = expert_layer_torch(x, blocks, geom, ug, dg, w)
    k = len(blocks)
    pinned = [b.cpu().pin_memory() for b in blocks]
    dma = ChosenUpDMA(k, geom.down_off, DEVICE, batch=2)
    # compile both variants first (a first call compiles for seconds, long past the held-back copies)
    warm = ChosenUpDMA(k, geom.down_off, DEVICE, batch=2)
    got = warm.copy(list(range(k)), [p.data_ptr() for p in pinned])
    for r in ((_waits(*got[1:]), warm.flags), None):
        expert_layer(x, block_addresses(blocks, DEVICE), geom, ug, dg, w,
                     up_addrs=torch.tensor(got[0], dtype=torch.int64, device=DEVICE), up_ready=r)
    torch.cuda.synchronize()
    with torch.cuda.stream(dma.stream):
        torch.cuda._sleep(40_000_000)
    pos = list(range(k))
    ups, want, flag, order = dma.copy(pos, [p.data_ptr() for p in pinned])
    addrs = block_addresses(blocks, DEVICE)
    broken = [b.clone() for b in blocks]
    for b in broken:
        b[: geom.down_off] = 0x77
    addrs = block_addresses(broken, DEVICE)
    up = torch.tensor(ups, dtype=torch.int64, device=DEVICE)
    ready = (_waits(want, flag, order), dma.flags) if waits else None
    out = expert_layer(x, addrs, geom, ug, dg, w, up_addrs=up, up_ready=ready)
    done = dma.stream.query()
    torch.cuda.synchronize()
    assert not done, "the copies had finished before the kernel: the test shows nothing"
    if waits:
        assert_close(out, ref, TOL, "kernel waited for its ups")
    else:
        assert rel_err(out, ref) > 0.05


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy engine against a running kernel: CUDA")
@pytest.mark.parametrize("flag", ["copy", "write", "never"])
@pytest.mark.parametrize("batch", [1, 2])
def test_gpu_staged_ups_flagged_by_copy_or_stream_write(flag, batch):
    """UpStaging in non-blocking mode, its copies held back behind a busy staging stream while the kernel is queued on
    the compute stream with `take`'s waits: with the flags set by the copy engine or by a stream memory write
    (cuStreamWriteValue64) the kernel waits and gives the twin's result. Must-fail twin ("never": the flags' setting
    dropped): the kernel's programs give up waiting (counted) and read the staging buffer's stale bytes."""
    from gpu_worker.up_staging import UpStaging
    geom, blocks, ug, dg, x, w = _case(k=6, L=64, I=112)
    ref = expert_layer_torch(x, blocks, geom, ug, dg, w)
    k = len(blocks)
    pinned = [b.cpu().pin_memory() for b in blocks]
    staged = [0, 2, 3, 5]
    broken = [b.clone() for b in blocks]
    for p in staged:
        broken[p][: geom.down_off] = 0x77         # the staged experts' ups must come from the staging buffer
    addrs = block_addresses(broken, DEVICE)
    cfg = dict(BLOCK_N=16, BLOCK_K=32, BLOCK_L=64, SPIN_LIMIT=1 << 22)
    ups = UpStaging(k, geom.down_off, DEVICE)
    ups.extra, ups.batch, ups.flag_write = 3, batch, "copy" if flag == "never" else flag
    if flag == "never":
        ups._signal = lambda lo, hi: [ups._wait_slot.__setitem__(i, (ups.epoch + 1, lo)) for i in range(lo, hi)]
    ups.buf.fill_(0x33)
    cfg_run = cfg if flag != "never" else dict(cfg, SPIN_LIMIT=64)
    expert_layer(x, addrs, geom, ug, dg, w, config=cfg_run,          # compiled first (nothing to wait for)
                 up_addrs=addrs, up_ready=(_waits([0] * k, [0] * k, list(range(k))), ups.flags))
    torch.cuda.synchronize()
    with torch.cuda.stream(ups.stream):
        torch.cuda._sleep(40_000_000)
    ups.stage(1, staged, [pinned[p].data_ptr() for p in staged], [])
    got = ups.take(1, list(range(k)), blocking=False)
    assert sorted(got) == staged
    want = [ups.wait_of[p][0] if p in got else 0 for p in range(k)]
    fl = [ups.wait_of[p][1] if p in got else 0 for p in range(k)]
    up = torch.tensor([got.get(p, addrs[p].item()) for p in range(k)], dtype=torch.int64, device=DEVICE)
    out = expert_layer(x, addrs, geom, ug, dg, w, config=cfg_run, up_addrs=up,
                       up_ready=(_waits(want, fl, list(range(k))), ups.flags))
    done = ups.stream.query()
    torch.cuda.synchronize()
    assert not done, "the copies had finished before the kernel: the test shows nothing"
    if flag == "never":
        assert ups.gave_up() > 0 and rel_err(out, ref) > 0.05
    else:
        assert ups.gave_up() == 0
        assert_close(out, ref, TOL, f"staged ups flagged by {flag}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy engine against a running kernel: CUDA")
def test_gpu_copies_queued_after_the_kernel():
    """The engine's order: the kernel launched on the plan's waits first, the copies queued after it (the host's
    copy calls off the path to the launch); the kernel spins until they land and gives the twin's result."""
    geom, blocks, ug, dg, x, w = _case(k=7, L=64, I=112)
    ref = expert_layer_torch(x, blocks, geom, ug, dg, w)
    k = len(blocks)
    pinned = [b.cpu().pin_memory() for b in blocks]
    dma = ChosenUpDMA(k, geom.down_off, DEVICE, batch=2)
    pos = [0, 1, 3, 4, 6]
    ups, want, flag, order = dma.plan(pos)
    broken = [b.clone() for b in blocks]
    for p in pos:
        broken[p][: geom.down_off] = 0x77
    addrs = block_addresses(broken, DEVICE)
    up = torch.tensor([ups[p] if p in pos else addrs[p].item() for p in range(k)], dtype=torch.int64, device=DEVICE)
    out = expert_layer(x, addrs, geom, ug, dg, w, up_addrs=up, up_ready=(_waits(want, flag, order), dma.flags))
    dma.issue(pos, [pinned[p].data_ptr() for p in pos], want)
    torch.cuda.synchronize()
    assert_close(out, ref, TOL, "copies queued after the kernel")


def test_expert_inputs_reset_the_waits_after_a_route_with_waits():
    """set_addresses skips rewriting the wait rows while no route had waits (host time on the critical path), so a
    route without waits after one with them must still clear them: a kernel would otherwise spin on a stale flag."""
    from gpu_worker.decode_graphs import ExpertInputs
    k = 5
    inp = ExpertInputs.like(torch.zeros(1, 8), None, (torch.zeros(k), torch.zeros(k)), torch.zeros(k), pinned=False)
    blocks = [4096 * (i + 1) for i in range(k)]
    inp.set_addresses(blocks)
    assert inp.addresses[2:4].eq(0).all() and inp.addresses[4].tolist() == list(range(k))
    inp.set_addresses(blocks, up_waits=([7] * k, [1] * k, [4, 3, 2, 1, 0]))
    assert inp.addresses[2].tolist() == [7] * k and inp.addresses[4].tolist() == [4, 3, 2, 1, 0]
    inp.set_addresses(blocks)
    assert inp.addresses[2:4].eq(0).all() and inp.addresses[4].tolist() == list(range(k))
    assert inp.addresses[0].tolist() == blocks
    # must-fail twin: a skip that ignored the last route's waits leaves them for the kernel to spin on
    inp.set_addresses(blocks, up_waits=([7] * k, [1] * k, [4, 3, 2, 1, 0]))
    inp._no_waits = True
    inp.set_addresses(blocks)
    assert inp.addresses[2].tolist() == [7] * k


@pytest.mark.parametrize("honest", [True, False])
def test_expert_inputs_rewrite_the_launch_order_unless_it_is_the_same_tuple(honest):
    """set_addresses skips row 4 (the kernel's launch order) when a route hands the tuple it wrote last (the identity
    of every non-blocking route, made once per k); another order in between must be written and then undone.
    Twin (honest=False): a skip by the tuple's value alone, which misses the list in between, is caught."""
    from gpu_worker.decode_graphs import ExpertInputs
    from gpu_worker.streaming import _no_waits
    k = 5
    inp = ExpertInputs.like(torch.zeros(1, 8), None, (torch.zeros(k), torch.zeros(k)), torch.zeros(k), pinned=False)
    blocks = [4096 * (i + 1) for i in range(k)]
    none, order = _no_waits(k)
    assert _no_waits(k)[1] is order and order == tuple(range(k))
    seen = []
    for o in (order, [4, 3, 2, 1, 0], order):
        inp.set_addresses(blocks, up_waits=(none, none, o))
        seen.append(inp.addresses[4].tolist())
        if not honest:
            inp._order_row = order                  # as if every write had been of the identity tuple
    assert (seen == [list(range(k)), [4, 3, 2, 1, 0], list(range(k))]) == honest, seen


@pytest.mark.parametrize("counted", [True, False])
def test_take_hands_the_stages_ups_and_waits_and_counts_the_ranks_used(counted, monkeypatch):
    """On the CPU: `take` gives the chosen experts that were staged with their up sections' addresses, `wait_of` their
    batches' (epoch, flag), and the ranks used are counted off the route (at the next stage, or when read).
    Twin (counted=False): ranks never counted are caught."""
    from gpu_worker.up_staging import UpStaging
    ups = UpStaging(4, 64, "cpu")
    ups.extra, ups.batch = 3, 2
    if not counted:
        monkeypatch.setattr(ups, "_count_taken", lambda: None)
    blocks = [torch.full((128,), i, dtype=torch.uint8) for i in range(3)]
    ups.stage(1, [10, 20, 30], [0, 0, 0], [7, 8, 9], views=blocks)
    got = ups.take(1, [30, 5, 10], blocking=False)
    assert got == {30: ups._address[2], 10: ups._address[0]} and ups.take(1, [30]) == {}    # consumed
    assert [ups.wait_of[e] for e in (10, 30)] == [ups._wait_slot[0], ups._wait_slot[2]]
    assert ups._wait_slot[0] != ups._wait_slot[2] and ups.buf[2, :64].eq(2).all()
    ups.stage(2, [40], [0], [6], views=blocks[:1])
    assert (ups.used_by_rank == [1, 0, 1, 0]) == counted, ups.used_by_rank
    assert ups.staged_by_rank == [2, 1, 1, 0]


@pytest.mark.parametrize("after", ["progress", "event"])
def test_progress_stages_alternate_two_buffers_and_hand_launch_gates(after):
    """On the CPU: with "progress" each stage goes into the other of two buffers (the kernel that releases it may still
    read the last one) and `take` hands the addresses in the buffer staged last; `launch_gate` gives growing epochs
    and the per mille of `gate_at`. With "event" one buffer and no gate (the twin of the alternation)."""
    from gpu_worker.up_staging import UpStaging
    ups = UpStaging(3, 64, "cpu")
    ups.extra, ups.batch, ups.after, ups.gate_at = 3, 2, after, 0.85
    blocks = [torch.full((128,), i + 1, dtype=torch.uint8) for i in range(4)]
    seen = []
    for layer in range(3):
        gate = ups.launch_gate()
        ups.stage(layer, [10, 20], [0, 0], [], views=blocks[layer:layer + 2], launch_epoch=gate and gate[0])
        got = ups.take(layer, [20, 10], blocking=False)
        seen.append(got[10])
        now = ups._bufs[ups._current]
        assert now[0, :64].eq(layer + 1).all() and now[1, :64].eq(layer + 2).all()
        if after == "progress":
            assert gate == (layer + 1, 850)
        else:
            assert gate is None
    if after == "progress":
        assert seen[0] == seen[2] != seen[1] and ups.nbytes == 2 * ups.buf.numel()
    else:
        assert seen[0] == seen[1] == seen[2] and ups.nbytes == ups.buf.numel()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the staging stream against a running kernel: CUDA")
@pytest.mark.parametrize("buffers", [2, 1])
def test_gpu_progress_stage_spares_the_buffer_its_kernel_reads(buffers):
    """"progress": a stage's copies may start while the kernel that reads the last stage still runs (its gate written
    early, as the kernel's program writes it at the per-mille share); they go into the other buffer, so the running
    reader (a sleep, then a read) sees its own stage's bytes, and the copies land. Must-fail twin (one buffer): the
    copies overwrite the bytes under the reader."""
    from gpu_worker.up_staging import UpStaging
    n, ub = 3, 4096
    ups = UpStaging(n, ub, DEVICE)
    ups.after = "progress"
    src = [torch.randint(0, 256, (ub,), dtype=torch.uint8).pin_memory() for _ in range(2 * n)]
    ups.stage(0, list(range(n)), [t.data_ptr() for t in src[:n]], [])       # no launch gate: after the compute stream
    torch.cuda.synchronize()
    first = ups._bufs[ups._current]
    mine = torch.stack(src[:n]).to(DEVICE)
    assert torch.equal(first[:, :ub], mine)
    if buffers == 1:
        ups._next_buffer = lambda: None
    epoch, _ = ups.launch_gate()
    ups.gate[1].fill_(epoch)                      # the reader's gate, written before it ends
    torch.cuda._sleep(50_000_000)
    seen = first[:, :ub].clone()
    ups.stage(1, list(range(n)), [t.data_ptr() for t in src[n:]], [], launch_epoch=epoch)
    torch.cuda.synchronize()
    assert torch.equal(ups._bufs[ups._current][:, :ub], torch.stack(src[n:]).to(DEVICE)), "the copies did not land"
    if buffers == 2:
        assert torch.equal(seen, mine), "the stage overwrote the buffer its kernel still read"
    else:
        assert not torch.equal(seen, mine), "one buffer, and the reader kept its bytes: the test shows nothing"


class _Copies:
    """A CUDA event's query, for `take`'s judgement of the copies on the CPU."""

    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done


@pytest.mark.parametrize("judged", [True, False])
def test_take_judges_the_copies_it_gets(judged):
    """On CUDA `take` adapts the layer's limit by whether the judged copies were done: late ones take one off.
    Run here with the CUDA flag forced and an event's query faked (non-blocking: no stream wait). Twin
    (judged=False): a take that leaves the limit alone is caught."""
    from gpu_worker.up_staging import UpStaging
    ups = UpStaging(4, 64, "cpu")
    ups.extra = 3
    blocks = [torch.zeros(128, dtype=torch.uint8)] * 2
    ups.stage(1, [10, 20], [0, 0], [7, 8], views=blocks)
    ups.cuda, ups._core = judged, _Copies(done=False)
    assert ups.take(1, [20], blocking=False) == {20: ups._address[1]}
    assert (ups.limit == {1: 3}) == judged, ups.limit


class _Event:
    """A CUDA event's query, counted: the copies done (`done`) or not."""

    def __init__(self, done: bool):
        self.done, self.queries = done, 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


@pytest.mark.parametrize("after", [False, True])
def test_a_stage_is_judged_in_the_take_or_after_the_launch(after):
    """MOESTREAM_STAGE_JUDGE_AFTER: whether a layer's staged copies were done in time (the event query that moves its
    next limit by one) is asked inside the take (the route, before the launch) by default, or once its ranks are
    counted after the launch (`count_taken`): the take then makes no CUDA call. Either way each take is judged once,
    done → one more, not done → one fewer. (The host path of the CUDA branch, with a stand-in event.)"""
    from gpu_worker.up_staging import UpStaging
    ups = UpStaging(8, 64, "cpu")
    ups.cuda, ups.extra, ups.judge_after = True, 3, after     # (the non-blocking take: no stream wait is queued)
    for done, want in ((True, 6), (False, 4)):
        ev = _Event(done)
        ups.limit[2], ups.done, ups._core, ups._waited = 5, ev, None, False
        ups.layer, ups.slot_of = 2, {e: i for i, e in enumerate((7, 9, 11))}
        ups._up_of, ups._epoch_of, ups._flag_of = {7: 1, 9: 2, 11: 3}, {}, {}
        rows = ups.take_rows(2, [9, 4], [100, 200])
        assert rows[0] == [2, 200]
        assert ev.queries == (0 if after else 1) and ups.limit[2] == (5 if after else want)
        assert ups.count_taken() == 1
        assert ev.queries == 1 and ups.limit[2] == want, "judged once, after the launch at the latest"
