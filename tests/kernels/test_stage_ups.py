"""The device staging's kernels (kernels/stage_ups.py) against their twins, on fresh random bytes with odd sizes."""
import pytest
import torch

from kernels.stage_ups import stage_late, stage_ups, stage_ups_torch, up_addresses, up_addresses_torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def zeros(n=1, fill=0):
    return torch.full((n,), fill, dtype=torch.int64, device=DEV)


def rig(seed: int, experts: int = 37, slot_bytes: int = 1552, span: int = 1003, rows: int = 7):
    g = torch.Generator().manual_seed(seed)
    slab = torch.randint(0, 256, (experts + 3, slot_bytes), dtype=torch.uint8, generator=g)
    if DEV == "cuda":
        slab = slab.pin_memory()
    slots = torch.randperm(experts + 3, generator=g)[:experts]           # each expert's slot, shuffled
    table = (slab.data_ptr() + slots * slot_bytes).to(DEV)
    guess = torch.randperm(experts, generator=g)[:rows].to(DEV)
    stride = -(-span // 256) * 256
    dst = torch.randint(0, 256, (rows, stride), dtype=torch.uint8, generator=g).to(DEV)
    return slab, slots, table, guess, dst, span


def staged(n, programs, seed, table=None):
    slab, slots, tab, guess, dst, span = rig(seed)
    want, want_ids = stage_ups_torch(guess.cpu(), n, slots, slab, dst.cpu().clone(), span)
    ids, owner, progress = zeros(dst.shape[0], 5), zeros(), zeros()
    stage_ups(guess, torch.tensor([n], dtype=torch.int32, device=DEV), tab if table is None else table(tab, guess),
              dst, ids, owner, progress, 3, span, programs)
    return dst.cpu(), ids.cpu(), owner, progress, want, want_ids, span


@pytest.mark.parametrize("n,programs", [(5, 3), (7, 1), (0, 2), (9, 4)])
def test_staged_rows_equal_the_twin(n, programs):
    got, ids, owner, progress, want, want_ids, span = staged(n, programs, n * 10 + programs)
    rows = min(n, got.shape[0])
    assert torch.equal(got[:rows, :span], want[:rows, :span])
    assert torch.equal(got[rows:], want[rows:])               # rows past n untouched
    assert torch.equal(ids, want_ids) and int(owner) == 3 and int(progress) == programs
    if rows > 1:        # the rows are the guessed experts' bytes, not the same bytes everywhere
        assert not torch.equal(got[0, :span], got[rows - 1, :span])


def test_twin_table_of_swapped_addresses_is_caught():
    """Must-fail twin: a table whose first two guessed experts' addresses are swapped stages other bytes."""
    def swapped(tab, guess):
        bad = tab.clone()
        g0, g1 = int(guess[0]), int(guess[1])
        bad[g0], bad[g1] = tab[g1], tab[g0]
        return bad
    got, _, _, _, want, _, span = staged(5, 2, 3, table=swapped)
    assert not torch.equal(got[:2, :span], want[:2, :span])


def test_misaligned_rows_are_refused():
    slab, slots, table, guess, dst, span = rig(4)
    with pytest.raises(ValueError, match="aligned"):
        stage_ups(guess, torch.tensor([2], dtype=torch.int32, device=DEV), table, dst[:, :span - 1],
                  zeros(dst.shape[0]), zeros(), zeros(), 0, span, 1)


def addresses_rig(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(41, generator=g)[:7]
    ids[5:] = -1                                    # a staging of n = 5
    pool = torch.unique(torch.cat([ids[:5][torch.randperm(5, generator=g)[:3]], torch.randperm(41, generator=g)[:8]]))
    chosen = pool[torch.randperm(pool.numel(), generator=g)]
    blocks = torch.randint(1 << 20, 1 << 40, (chosen.numel(),), generator=g)
    return ids, chosen, blocks


@pytest.mark.parametrize("owner", [2, 4])
def test_up_addresses_equal_the_twin(owner):
    ids, chosen, blocks = addresses_rig(owner)
    dst = torch.empty(7, 512, dtype=torch.uint8, device=DEV)
    want = up_addresses_torch(chosen, ids, owner == 2, blocks, dst.data_ptr(), 512)
    out = torch.empty(chosen.numel(), dtype=torch.int64, device=DEV)
    own, progress = zeros(fill=owner), zeros(fill=7)
    up_addresses(chosen.to(DEV), ids.to(DEV), own, blocks.to(DEV), dst, out, progress, 2)
    assert torch.equal(out.cpu(), want)
    staged_hits = len(set(chosen.tolist()) & set(ids[:5].tolist()))
    assert (out.cpu() != blocks).sum() == (staged_hits if owner == 2 else 0) and staged_hits > 0
    assert int(own) == (-1 if owner == 2 else owner) and int(progress) == 0     # consumed: owner -1


def test_twin_addresses_from_shifted_ids_are_caught():
    """Must-fail twin: the addresses of ids shifted by one rank differ from the staged rows'."""
    ids, chosen, blocks = addresses_rig(9)
    dst = torch.empty(7, 256, dtype=torch.uint8, device=DEV)
    out = torch.empty(chosen.numel(), dtype=torch.int64, device=DEV)
    up_addresses(chosen.to(DEV), torch.roll(ids, 1).to(DEV), zeros(fill=1), blocks.to(DEV), dst, out, zeros(), 1)
    assert not torch.equal(out.cpu(), up_addresses_torch(chosen, ids, True, blocks, dst.data_ptr(), 256))


def test_lateness_counts_a_staging_not_done():
    progress, late = zeros(fill=3), zeros()
    stage_late(progress, late, 3)
    assert int(late) == 0
    progress -= 1
    stage_late(progress, late, 3)
    assert int(late) == 1
