"""The RAM regime's default decode route on the host, the next layer's guessed ups staged non-blocking (as
`bench.host_bookkeeping`'s `staged` scenario runs it): over a trace of tokens, the five rows that
`ExpertInputs.set_addresses` writes for the kernel (blocks, ups, epochs, flags, launch order), the staging buffer's
bytes, the messages and the counts, each against what the staging's rules say they must be, computed here apart
from the code: a layer's staged experts are the previous layer's guess in rank order, all of it (the cache holds
every block); batches of two, each with a fresh epoch in its first slot's flag. The device is the CPU: copies by
address (a memmove, where the GPU calls cuMemcpyAsync)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cache_shm.client import MSG_LAYER
from gpu_worker.decode_graphs import ExpertInputs
from gpu_worker.up_staging import UpStaging
from tests.gpu_worker.test_streaming_route import K, N_EXPERTS, N_MOE, messages, rig  # noqa: F401 (a fixture)

TOKENS = 12


def trace(seed: int):
    """[(token, layer, chosen, guess for the next layer)]: the guess shares 4 of K with the next layer's choice."""
    rng = np.random.default_rng(seed)
    choice = [[rng.choice(N_EXPERTS, K, replace=False).tolist() for _ in range(N_MOE)] for _ in range(TOKENS + 1)]
    out = []
    for t in range(TOKENS):
        for j in range(N_MOE):
            nt, nj = (t, j + 1) if j + 1 < N_MOE else (t + 1, 0)
            nxt = choice[nt][nj]
            others = [e for e in rng.permutation(N_EXPERTS).tolist() if e not in nxt]
            guess = nxt[:4] + others[:K - 4]
            out.append((t, j, choice[t][j], [guess[i] for i in rng.permutation(K)]))
    return out


def staged_source(src):
    """The rig's source staging the next layer's guessed ups, non-blocking, CPU copies and pins (the bench's
    `staging_on_cpu`)."""
    src.slab.copy_(torch.randint(0, 256, src.slab.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    src._cuda = False            # (every block's bytes its own: a copy from the wrong one shows)
    src.stage_ups = True
    src.stage_extra = 3
    src.up_dma_limit = 0
    return src


def route_problems(src, shm, slot_of) -> list[str]:
    bad = []
    base, sb = src.slab.data_ptr(), src.slot_bytes
    slab = src.slab
    inp = ExpertInputs.like(torch.zeros(1, 8), None, None, torch.zeros(1, K), pinned=False)
    staged = None            # (layer, the experts staged for it, in buffer-slot order, first epoch, the buffer)
    epoch = 0
    last_gate = None
    used = staged_total = 0
    used_by_rank = [0] * K
    for t, j, chosen, guess in trace(0):
        r = src.decode_route(j, 2 * j + 1, list(chosen), list(guess))
        if r.addresses is None:
            return bad + [f"token {t} layer {j}: not addressed"]
        inp.set_addresses(r.addresses, r.up_addresses, r.up_waits)
        rows = inp.addresses_host.tolist()
        blocks = [base + slot_of[j, e] * sb for e in chosen]
        ups, epochs, flags = list(blocks), [0] * K, [0] * K
        if staged is not None and staged[0] == j:
            first_epoch, order = staged[2], staged[1]
            for p, e in enumerate(chosen):
                if e in order:
                    i = order.index(e)
                    ups[p] = staged[3][i].data_ptr()
                    epochs[p], flags[p] = first_epoch + i // 2, i - i % 2
                    used += 1
                    used_by_rank[i] += 1
        # the launch gate ("progress", the default): the route's epoch, one past the last, and the per mille (0.9)
        gate = src._launch_epoch
        if gate is not None and last_gate is not None and gate != last_gate + 1:
            bad.append(f"token {t} layer {j}: launch gate epoch {gate} after {last_gate}")
        last_gate = gate if gate is not None else last_gate
        want = [blocks, ups, epochs, flags, list(range(K)), [gate, 900] + [0] * (K - 2) if gate else [0] * K]
        if rows != want:
            bad.append(f"token {t} layer {j}: rows {rows} != {want}")
        if messages(shm):
            bad.append(f"token {t} layer {j}: a message before the launch")
        src.decode_launched()
        src.decode_stage()
        got = messages(shm)
        if got != [[MSG_LAYER, j, chosen, (j + 1) % N_MOE, guess]]:
            bad.append(f"token {t} layer {j}: messages {got}")
        nj = (j + 1) % N_MOE
        buf = src.ups._bufs[src.ups._current]
        if staged is not None and buf is staged[3]:
            bad.append(f"token {t} layer {j}: staged into the buffer the last stage filled")
        staged = (nj, list(guess), epoch + 1, buf)
        epoch += -(-K // 2)
        staged_total += K
        ub = src._up_span
        for i, e in enumerate(guess):          # the buffer holds the next layer's guessed ups, in rank order
            if not torch.equal(buf[i, :ub], slab[slot_of[nj, e], :ub]):
                bad.append(f"token {t}: staged up of layer {nj} expert {e} (slot {i}) differs from its block")
        if src.ups.flags[:K:2].tolist() != [staged[2] + b for b in range(-(-K // 2))]:     # a batch's epoch
            bad.append(f"token {t} layer {j}: flags {src.ups.flags[:K].tolist()}")
    a = src.acct
    if (a.ups_staged, a.ups_staged_used) != (staged_total, used):
        bad.append(f"staged {a.ups_staged} used {a.ups_staged_used}, want {staged_total} {used}")
    routed = TOKENS * N_MOE * K
    if a.bytes_over_pcie != (routed - used + staged_total) * src.geom.up_bytes:
        bad.append(f"bytes over PCIe {a.bytes_over_pcie}")
    if (a.hits_at_lookup, a.misses_at_lookup, a.tokens) != (routed, 0, TOKENS):
        bad.append(f"counts {a.hits_at_lookup} {a.misses_at_lookup} {a.tokens}")
    if src.ups.used_by_rank != used_by_rank:
        bad.append(f"ranks used {src.ups.used_by_rank} != {used_by_rank}")
    src.decode_launched()
    src._flush(sync=False)
    if int(shm.slot_pins.sum()) != 0:
        bad.append(f"pins left: {int(shm.slot_pins.sum())}")
    return bad


def test_the_staged_route_writes_what_the_staging_says(rig):
    src, shm, slot_of = rig
    assert route_problems(staged_source(src), shm, slot_of) == []
    assert src.ups.by_address and src.ups.extra == 3         # the path named: copies by address, non-blocking


@pytest.mark.parametrize("broken", ["copies_from_the_wrong_block", "waits_of_the_wrong_batch"])
def test_twin_broken_staging_is_caught(rig, monkeypatch, broken):
    src, shm, slot_of = rig
    if broken == "copies_from_the_wrong_block":
        stage = UpStaging.stage

        def wrong(self, layer, experts, addresses, slots, views=None, launch_epoch=None):
            return stage(self, layer, experts, addresses[1:] + addresses[:1], slots, views, launch_epoch)
        monkeypatch.setattr(UpStaging, "stage", wrong)
    else:
        signal = UpStaging._signal

        def late(self, lo, hi):
            signal(self, lo, hi)
            for i in range(lo, hi):
                self._wait_slot[i] = (self.epoch + 1, lo)
        monkeypatch.setattr(UpStaging, "_signal", late)
    assert route_problems(staged_source(src), shm, slot_of) != []


@pytest.mark.parametrize("by_address", [True, False])
def test_cpu_staging_copies_by_address_the_bytes_the_views_give(by_address, monkeypatch):
    """On the CPU `stage` copies from the blocks' addresses (a memmove) unless it is given their views: the same bytes
    either way. Twin: a memmove one byte short is caught."""
    import gpu_worker.up_staging as us
    ups = UpStaging(3, 100, "cpu")
    blocks = torch.randint(0, 256, (3, 256), dtype=torch.uint8)
    if not by_address:
        monkeypatch.setattr(ups, "_memcpy", lambda dst, src, n, stream=None: us.host_memcpy(dst, src, n - 1))
    ups.stage(0, [5, 6, 7], [b.data_ptr() for b in blocks], [0, 1, 2])
    by_view = UpStaging(3, 100, "cpu")
    by_view.stage(0, [5, 6, 7], [0, 0, 0], [0, 1, 2], views=list(blocks))
    assert torch.equal(by_view.buf[:, :100], blocks[:, :100])
    assert torch.equal(ups.buf[:, :100], blocks[:, :100]) == by_address


@pytest.mark.parametrize("fresh", [True, False])
def test_take_rows_are_what_take_gives_as_the_kernels_rows(fresh, monkeypatch):
    """`take_rows` (the route's one pass) against `take` + `wait_of` (the contract it replaces on the route), over
    stages of random guesses: the same ups, (epoch, flag) and ranks used, each stage consumed. Twin (fresh=False):
    rows read from the first stage's maps are caught."""
    rng = np.random.default_rng(3)
    a, b = UpStaging(6, 64, "cpu"), UpStaging(6, 64, "cpu")
    a.extra = b.extra = 3
    blocks = torch.zeros(6, 128, dtype=torch.uint8)
    addresses = [blocks[i].data_ptr() for i in range(6)]
    first = None
    for layer in range(20):
        staged = rng.choice(40, int(rng.integers(1, 7)), replace=False).tolist()
        for u in (a, b):
            u.stage(layer, staged, addresses[:len(staged)], list(range(len(staged))))
        if not fresh:
            first = first or (b._up_of, b._epoch_of, b._flag_of)
            b._up_of, b._epoch_of, b._flag_of = first
        chosen = rng.choice(40, 6, replace=False).tolist()
        mine = [1000 + e for e in chosen]
        got = a.take(layer, chosen, blocking=False)
        slot = {ad: i for i, ad in enumerate(a._address)}        # (the two buffers differ: b's addresses for a's)
        want = ([b._address[slot[got[e]]] if e in got else m for e, m in zip(chosen, mine)],
                [a.wait_of[e][0] if e in got else 0 for e in chosen], [a.wait_of[e][1] if e in got else 0 for e in chosen])
        rows = b.take_rows(layer, chosen, mine)
        assert b.count_taken() == len(got) or not fresh
        if rows != want:
            assert not fresh, (layer, rows, want)
            return
        assert b.take_rows(layer, chosen, mine) is None and a.take(layer, chosen) == {}      # consumed
    assert a.used_by_rank == b.used_by_rank and fresh


def test_set_addresses_packed_rows_equal_numpy_and_fall_back():
    """The staged route's rows written by one cached Struct (h-host13) equal numpy's writes; what the Struct refuses
    (numpy ints, a wrong length, a value past int64) goes through numpy as before, or fails as numpy would."""
    import numpy as np

    from gpu_worker.decode_graphs import ExpertInputs
    k = 5
    rng = np.random.default_rng(3)

    def fresh():
        return ExpertInputs.like(torch.zeros(1, 8), None, (torch.zeros(k), torch.zeros(k)), torch.zeros(k),
                                 pinned=False)

    def expect(rows, order, gate=(0, 0)):
        want = np.zeros((6, k), dtype=np.int64)
        want[:4] = rows
        want[4] = order
        want[5, :2] = gate
        return want
    for _ in range(4):
        rows = [[int(v) for v in rng.integers(-(1 << 62), 1 << 62, size=k)] for _ in range(4)]
        order = tuple(int(v) for v in rng.permutation(k))
        inp = fresh()
        inp.set_addresses(rows[0], rows[1], (rows[2], rows[3], order))
        assert (inp.addresses_host.numpy() == expect(rows, order)).all()
        two = fresh()                                       # no waits: rows 2-3 zero, row 4 the identity
        two.set_addresses(rows[0], rows[1])
        assert (two.addresses_host.numpy() == expect([rows[0], rows[1], [0] * k, [0] * k], range(k))).all()
    inp = fresh()                  # a launch gate (epoch, per mille) in row 5, zeroed by the next route without one
    inp.set_addresses(rows[0], rows[1], (rows[2], rows[3], order, (41, 900)))
    assert (inp.addresses_host.numpy() == expect(rows, order, (41, 900))).all()
    inp.set_addresses(rows[0], rows[1], (rows[2], rows[3], order, None))
    assert (inp.addresses_host.numpy() == expect(rows, order)).all()
    inp.set_addresses(rows[0], rows[1], (rows[2], rows[3], order, (42, 900)))
    inp.set_addresses(rows[0], rows[1])
    assert (inp.addresses_host.numpy() == expect([rows[0], rows[1], [0] * k, [0] * k], range(k))).all()
    inp = fresh()
    np_rows = [np.asarray(r, dtype=np.int64) for r in rows]       # not Python ints: the numpy path
    inp.set_addresses(np_rows[0], list(np_rows[1]), (rows[2], rows[3], list(order)))
    assert (inp.addresses_host.numpy() == expect(rows, order)).all()
    with pytest.raises(ValueError):                               # a wrong length fails as numpy's write does
        fresh().set_addresses(rows[0][:-1], rows[1], (rows[2], rows[3], order))
    with pytest.raises(OverflowError):                            # past int64: numpy refuses it too
        fresh().set_addresses([1 << 63] + rows[0][1:], rows[1], (rows[2], rows[3], order))
