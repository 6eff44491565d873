"""The VRAM tier's copies on a stream of their own (gpu_worker/vram_tier.py `set_copy_stream`,
MOESTREAM_VRAM_COPY_STREAM): an admitted block is neither free nor resident until its batch's event has passed and a
`settle` makes it a resident (the device table written then), it is not admitted twice meanwhile, a whole-layer fill
does not ask for it again, and switching the stream off waits for what is in flight. On the CPU with a stand-in
stream whose events pass when the test says; on the GPU the lend's decode with the real stream."""
from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from gpu_worker.generate import generate
from gpu_worker.prefill import prefill
from gpu_worker.sampling import SamplingParams
from gpu_worker.vram_tier import VramTier
from tests.gpu_worker.test_prefill import prompt
from tests.gpu_worker.test_prefill_ahead import gpu_case
from tests.gpu_worker.test_streaming_pipeline import make_store

L, E, B = 2, 4, 64


@pytest.fixture(scope="module")
def tiny(synth, tmp_path_factory):
    model_dir = synth("tiny", "nvfp4")
    return model_dir, make_store(model_dir, tmp_path_factory.mktemp("tier-stream-store") / "tiny")


class Event:
    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class StandInStream:
    """Records the copy stream's calls; its events pass when the test sets them done."""

    def __init__(self):
        self.events: list[Event] = []
        self.fences = 0            # after_current calls
        self.queued = 0            # copies queued inside queue()
        self.kept = []             # buffers kept alive for its copies

    def keep(self, buf) -> None:
        self.kept.append(buf)

    def after_current(self) -> None:
        self.fences += 1

    @contextlib.contextmanager
    def queue(self):
        self.queued += 1
        yield

    def record(self) -> Event:
        self.events.append(Event())
        return self.events[-1]


def tier(n_slots: int, stream=None) -> VramTier:
    vt = VramTier(n_slots, B, B, "cpu", admit_after=1, n_layers=L, n_experts=E)
    vt.set_copy_stream(stream)
    return vt


def block(v: int) -> torch.Tensor:
    return torch.full((B,), v, dtype=torch.uint8)


def test_an_admitted_block_becomes_resident_when_its_copy_is_done():
    cs = StandInStream()
    vt = tier(2 * E, cs)
    for e in range(3):
        assert vt.want(0, e)
        vt.admit(0, e, block(e))
    assert cs.queued == 3 and cs.fences == 1          # one fence for a batch into free slots
    assert len(cs.kept) == 1 and cs.kept[0] is vt.buf, "the tier's buffer not kept for the copy stream's writes"
    ev = vt.seal()
    assert ev is cs.events[-1] and vt.seal() is None
    assert vt.in_flight() == 3 and not vt.slot_of and vt.table[0].tolist() == [0] * E
    assert vt.lookup(0, [0, 1, 2]) == {} and vt.admissions == 0
    assert not vt.want(0, 1), "a block on its way in was admitted again"
    assert len(vt.free) == 2 * E - 3                   # its slot is taken: neither free nor resident
    assert vt.settle() == 0 and vt.in_flight() == 3    # the copy not yet done
    ev.done = True
    assert vt.settle() == 3 and vt.in_flight() == 0 and vt.admissions == 3
    assert vt.table[0].tolist()[:3] == [vt.address(vt.slot_of[0, e]) for e in range(3)]
    assert set(vt.lookup(0, [0, 1, 2])) == {0, 1, 2}
    assert all(torch.equal(vt.block(vt.slot_of[0, e]), block(e)) for e in range(3))


def test_twin_without_a_copy_stream_is_resident_at_once():
    vt = tier(2 * E)
    vt.admit(0, 1, block(1))
    assert vt.seal() is None and vt.in_flight() == 0 and vt.admissions == 1
    assert vt.table[0, 1] == vt.address(vt.slot_of[0, 1])


def test_an_evicting_admission_fences_and_drops_its_victim_at_once():
    cs = StandInStream()
    vt = tier(E, cs)
    for e in range(E):
        vt.admit(0, e, block(e))
    vt.seal().done = True
    vt.settle()
    fences = cs.fences
    for _ in range(3):                       # layer 1's expert earns a place over the coldest resident
        if vt.want(1, 0):
            vt.admit(1, 0, block(9))
            break
    assert cs.fences == fences + 1, "an admission into an evicted slot was not ordered after the current stream"
    assert len(vt.slot_of) == E - 1 and vt.table[0].tolist().count(0) == 1   # the victim gone from the table now
    assert vt.table[1, 0] == 0 and vt.in_flight() == 1                     # the newcomer not yet
    vt.seal().done = True
    vt.settle()
    assert vt.table[1, 0] == vt.address(vt.slot_of[1, 0])


def test_a_fill_does_not_ask_again_for_blocks_on_their_way():
    cs = StandInStream()
    vt = tier(2 * E, cs)
    vt.admit(0, 0, block(0))
    vt.seal().done = True
    vt.settle()                              # layer 0: three missing
    for e in (0, 2, 3):
        vt.admit(1, e, block(e))
    vt.seal()                                # layer 1: three on their way, one missing
    assert vt.fillable() == (1, [1])
    # the twin: a tier that forgot what is in flight would take layer 0 as the nearest whole, or copy them twice
    keys = vt._inflight_keys
    vt._inflight_keys = set()
    assert vt.fillable() == (0, [1, 2, 3])
    vt._inflight_keys = keys


def test_switching_the_stream_off_waits_for_the_copies_in_flight():
    cs = StandInStream()
    vt = tier(2 * E, cs)
    vt.admit(0, 3, block(3))
    vt.set_copy_stream(None)
    assert vt.in_flight() == 0 and cs.events[0].done and vt.table[0, 3] == vt.address(vt.slot_of[0, 3])
    vt.admit(0, 2, block(2))
    assert cs.queued == 1 and vt.table[0, 2] != 0


def test_vram_knobs(monkeypatch):
    from gpu_worker.knobs import vram_copy_stream, vram_fill_blocks
    monkeypatch.delenv("MOESTREAM_VRAM_COPY_STREAM", raising=False)
    assert vram_copy_stream() and vram_fill_blocks() == 64
    monkeypatch.setenv("MOESTREAM_VRAM_COPY_STREAM", "0")
    monkeypatch.setenv("MOESTREAM_VRAM_FILL_BLOCKS", "16")
    assert not vram_copy_stream() and vram_fill_blocks() == 16
    monkeypatch.setenv("MOESTREAM_VRAM_COPY_STREAM", "yes")
    with pytest.raises(ValueError, match="MOESTREAM_VRAM_COPY_STREAM"):
        vram_copy_stream()


def tier_problems(src) -> list[str]:
    """What is wrong with a tier after decoding: a resident whose table entry is not its slot's address, or whose
    block is not the store's, a block still on its way, a slab pin left."""
    vt, st, bad = src.vram, src.store, []
    for (j, e), s in vt.slot_of.items():
        if int(vt.table[j, e]) != vt.address(s):
            bad.append(f"table ({j}, {e})")
        if not torch.equal(vt.block(s).cpu(), torch.from_numpy(st.read_block(j, e).copy())):
            bad.append(f"block ({j}, {e})")
    if vt.in_flight():
        bad.append(f"{vt.in_flight()} in flight")
    return bad


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy streams and events need CUDA")
@pytest.mark.parametrize("fill", ["64", "4"])
def test_gpu_the_tier_refills_on_its_copy_stream_after_a_lent_prompt(tiny, monkeypatch, fill):
    """On the GPU (bf16, staged, RAM, a VRAM tier of 48 slots): decode, a 700-token prompt that borrows half the
    tier, decode again with the tier's copies on their own stream (`fill` blocks a token), then the same with them in
    the compute stream: the same tokens every time, copies made on the stream, and every resident's table entry and
    block right once settled, nothing left pinned."""
    from gpu_worker import vram_tier
    monkeypatch.setenv("MOESTREAM_PREFILL_LEND_MIN_TOKENS", "0")
    monkeypatch.setenv("MOESTREAM_VRAM_FILL_BLOCKS", fill)
    batches, real = [], vram_tier.CopyStream.record

    def record(cs):
        batches.append(1)
        return real(cs)
    monkeypatch.setattr(vram_tier.CopyStream, "record", record)
    ids, _, eng = gpu_case(tiny)
    short = prompt(12, seed=7)
    with eng:
        src = eng.experts
        vt = src.vram = eng._vram_tier(torch.cuda.memory_allocated() + 48 * src.store.block_stride, 0, "cuda", 1)
        monkeypatch.setenv("MOESTREAM_VRAM_COPY_STREAM", "0")
        before = decoded(eng, short)
        runs = []
        for stream in (True, False):
            n0, a0 = len(batches), vt.admissions
            lent, toks = lend_then_decode(eng, short, ids, stream, monkeypatch)
            runs.append((stream, lent, toks, len(batches) - n0, vt.admissions - a0, vt.in_flight()))
            torch.cuda.synchronize()
            vt.settle(wait=True)
            assert tier_problems(src) == []
        pinned = int(eng.sup.shm.slot_pins.sum())
        src._flush(sync=True)
        assert int(eng.sup.shm.slot_pins.sum()) == 0, f"{pinned} pins left after decoding"
    print("GPU tier copies (stream, lent, batches, admissions, in flight at the end):",
          [(r[0], r[1], r[3], r[4], r[5]) for r in runs])
    for stream, lent, toks, n_batches, admitted, _ in runs:
        assert lent == 24 and toks == before and admitted > 0
        assert (n_batches > 0) == stream


def decoded(eng, short) -> list[int]:
    return [t.token for t in generate(eng, short, SamplingParams(max_tokens=12))]


def lend_then_decode(eng, short, ids, stream: bool, monkeypatch) -> tuple[int, list[int]]:
    """A prompt under 1 MiB (it borrows the tier's slots), then a short decode with the tier's copies on their stream
    or not: (slots lent, tokens)."""
    monkeypatch.setenv("MOESTREAM_VRAM_COPY_STREAM", "1" if stream else "0")
    m, src = eng.model, eng.experts
    prefill(m, ids, m.new_state(), budget_bytes=1 << 20)
    lent = dataclasses.replace(src.prefill_acct.last).ahead_lent
    return lent, decoded(eng, short)
