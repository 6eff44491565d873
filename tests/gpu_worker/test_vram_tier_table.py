"""The VRAM tier's side of device routing (gpu_worker/vram_tier.py): the device table follows every admission and
eviction, a layer is complete when every expert is resident, a held layer keeps its residents for the token (an
admission that would evict one is put off, and the layer yields the next token), and a tier with room for a whole
layer is filled whole. On the CPU, with blocks of 64 bytes."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.vram_tier import VramTier

L, E, B = 2, 4, 64


def tier(n_slots: int) -> VramTier:
    return VramTier(n_slots, B, B, "cpu", admit_after=1, n_layers=L, n_experts=E)


def block(v: int) -> torch.Tensor:
    return torch.full((B,), v, dtype=torch.uint8)


def test_table_follows_admissions_and_evictions():
    vt = tier(2 * E)
    for e in range(E):
        vt.admit(0, e, block(e))
    assert vt.complete(0) and not vt.complete(1)
    assert vt.table[0].tolist() == [vt.address(vt.slot_of[0, e]) for e in range(E)]
    assert vt.table[1].tolist() == [0] * E
    assert vt.routable() == {0}
    s = vt.evict(0, 2)
    assert vt.table[0, 2] == 0 and not vt.complete(0) and s in vt.free and vt.routable() == frozenset()
    # the free slots can take layer 0's missing expert, or layer 1 whole: the fewest missing first
    assert vt.fillable() == (0, [2])
    vt.admit(0, 2, block(9))
    assert vt.fillable() == (1, list(range(E)))
    assert torch.equal(vt.block(vt.slot_of[0, 2]), block(9))


def test_a_layer_not_complete_cannot_be_held():
    vt = tier(2 * E)
    vt.admit(1, 0, block(1))
    with pytest.raises(ValueError, match=r"MoE layers \[1\] are not complete"):
        vt.hold({1})


def held_layer_problems(vt: VramTier) -> list[str]:
    """Layer 0 whole in a full tier, held for a token; layer 1's expert 0 used until it earns a place."""
    bad = []
    for e in range(E):
        vt.admit(0, e, block(e))
    held = vt.hold(vt.routable())
    if held != {0}:
        bad.append(f"held {held}")
    row = vt.table[0].clone()
    for _ in range(3):                       # its count must beat the coldest resident's before it may evict
        if vt.want(1, 0):
            vt.admit(1, 0, block(7))
    if not torch.equal(vt.table[0], row) or not vt.complete(0):
        bad.append("a held layer lost a resident during its token")
    vt.hold()                                # the token's end
    if vt.routable() != frozenset():
        bad.append("the layer an admission waited for did not yield for a token")
    if not vt.want(1, 0):
        bad.append("the admission was not made once the layer yielded")
    else:
        vt.admit(1, 0, block(7))
        if vt.complete(0) or vt.table[1, 0] != vt.address(vt.slot_of[1, 0]):
            bad.append("the eviction after the yield did not reach the table")
    return bad


@pytest.mark.parametrize("honest", [True, False])
def test_held_layer_yields_to_an_admission(monkeypatch, honest):
    """Twin: a tier whose hold holds nothing lets the admission evict from the layer the token routes on the device."""
    vt = tier(E)
    if not honest:
        real = vt.hold
        monkeypatch.setattr(vt, "hold", lambda layers=frozenset(): (real(), frozenset(layers))[1])
    bad = held_layer_problems(vt)
    assert (bad == []) == honest, bad
    if honest:
        assert vt.refused >= 1


def test_evicting_a_held_resident_is_refused():
    vt = tier(E)
    for e in range(E):
        vt.admit(0, e, block(e))
    vt.hold({0})
    with pytest.raises(RuntimeError, match="this token routes on the device"):
        vt.admit(1, 0, block(1))
    with pytest.raises(ValueError, match="routed on the device this token"):
        vt.evict(0, 1)


def lent_tier() -> VramTier:
    """Both layers whole in a full tier, layer 1's experts used more the higher their number, layer 0's once each
    (then held for the token)."""
    vt = tier(2 * E)
    for j in range(L):
        for e in range(E):
            vt.admit(j, e, block(j * E + e))
    for e in range(E):
        for _ in range(e + 2):
            vt.lookup(1, [e])
    return vt


def test_a_lend_takes_free_slots_then_the_coldest_residents_not_held_and_takes_them_back():
    vt = lent_tier()
    vt.evict(1, 3)                              # one free slot
    vt.hold({0})                                # layer 0 routed on the device this token: its residents stay
    got = vt.lend(3)                            # at most half the tier (LEND_SHARE 2 of 8): 3 fit
    assert len(got) == 3 and got == sorted(got) and vt.lent == 3 and vt.lent_evictions == 2
    assert vt.complete(0) and set(vt.row(1)) == {2}, "the free slot, then layer 1's two coldest (0 and 1)"
    assert vt.table[1].tolist()[:2] == [0, 0] and not set(got) & set(vt.slot_of.values())
    more = vt.lend(4)                           # half the tier is the cap: one more
    assert len(more) == 1 and vt.lent == 2 * E // 2 and vt.lend(1) == []
    vt.hold()
    vt.take_back(got)
    assert vt.lent == 1 and set(got) <= set(vt.free)
    vt.admit(1, 0, block(5))                    # a returned slot serves an admission again
    assert vt.slot_of[1, 0] in got
    with pytest.raises(ValueError, match="given back"):
        vt.take_back(got)                       # the twin: returned twice, refused


def test_the_residents_a_lend_evicted_are_named_for_their_restore():
    """`take_lent_keys`: the residents the lends evicted, less any that came back meanwhile; asked once."""
    vt = lent_tier()
    vt.evict(1, 3)
    vt.hold({0})
    got = vt.lend(3)
    assert vt.lent_keys == [(1, 0), (1, 1)]
    vt.hold()
    vt.take_back(got)
    vt.admit(1, 1, block(4))                    # admitted again before the restore asked
    assert vt.take_lent_keys() == [(1, 0)] and vt.take_lent_keys() == []


def test_must_fail_a_lend_that_ignored_the_held_layer_would_empty_it():
    """The twin of the held rule: with nothing held, the coldest are layer 0's (used once each), and the lend takes
    them, so a held layer is what kept them above."""
    vt = lent_tier()
    vt.evict(1, 3)
    got = vt.lend(3)
    assert len(got) == 3 and not vt.complete(0)
