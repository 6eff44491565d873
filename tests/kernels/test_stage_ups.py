"""The device staging's kernels (kernels/stage_ups.py) against their twins, on fresh random bytes with odd sizes."""
import pytest
import torch

from kernels.stage_ups import stage_ups, stage_ups_torch, up_addresses, up_addresses_torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


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


@pytest.mark.parametrize("n,programs", [(5, 3), (7, 1), (0, 2), (9, 4)])
def test_staged_rows_equal_the_twin(n, programs):
    slab, slots, table, guess, dst, span = rig(n * 10 + programs)
    want = stage_ups_torch(guess.cpu(), n, slots, slab, dst.cpu().clone(), span)
    progress = torch.zeros(1, dtype=torch.int64, device=DEV)
    stage_ups(guess, torch.tensor([n], dtype=torch.int32, device=DEV), table, dst, progress, span, programs)
    got = dst.cpu()
    rows = min(n, dst.shape[0])
    assert torch.equal(got[:rows, :span], want[:rows, :span])
    assert torch.equal(got[rows:], want[rows:])               # rows past n untouched
    assert int(progress) == programs
    if rows:        # the rows are the guessed experts' bytes, not the same bytes everywhere
        assert not torch.equal(got[0, :span], got[rows - 1, :span]) or rows == 1


def test_twin_table_of_swapped_addresses_is_caught():
    """Must-fail twin: a table whose first two experts' addresses are swapped stages other bytes."""
    slab, slots, table, guess, dst, span = rig(3)
    want = stage_ups_torch(guess.cpu(), 5, slots, slab, dst.cpu().clone(), span)
    bad = table.clone()
    g0, g1 = int(guess[0]), int(guess[1])
    bad[g0], bad[g1] = table[g1], table[g0]
    stage_ups(guess, torch.tensor([5], dtype=torch.int32, device=DEV), bad, dst,
              torch.zeros(1, dtype=torch.int64, device=DEV), span, 2)
    assert not torch.equal(dst.cpu()[:2, :span], want[:2, :span])


def test_misaligned_rows_are_refused():
    slab, slots, table, guess, dst, span = rig(4)
    with pytest.raises(ValueError, match="aligned"):
        stage_ups(guess, torch.tensor([2], dtype=torch.int32, device=DEV), table, dst[:, :span - 1], 
                  torch.zeros(1, dtype=torch.int64, device=DEV), span, 1)


@pytest.mark.parametrize("n", [0, 3, 7])
def test_up_addresses_equal_the_twin_and_count_lateness(n):
    g = torch.Generator().manual_seed(n)
    guess = torch.randperm(41, generator=g)[:7]
    chosen = torch.cat([guess[torch.randperm(7, generator=g)[:3]], torch.randperm(41, generator=g)[:8]])
    chosen = torch.unique(chosen)[torch.randperm(torch.unique(chosen).numel(), generator=g)]   # distinct, shuffled
    blocks = torch.randint(1 << 20, 1 << 40, (chosen.numel(),), generator=g)
    dst = torch.empty(7, 512, dtype=torch.uint8, device=DEV)
    want = up_addresses_torch(chosen, guess, n, blocks, dst.data_ptr(), 512)
    out = torch.empty(chosen.numel(), dtype=torch.int64, device=DEV)
    progress, ticks, late = (torch.zeros(1, dtype=torch.int64, device=DEV) for _ in range(3))
    progress += 3                           # one staging of 3 programs done: on time
    nt = torch.tensor([n], dtype=torch.int32, device=DEV)
    up_addresses(chosen.to(DEV), guess.to(DEV), nt, blocks.to(DEV), dst, out, progress, ticks, late, 3)
    assert torch.equal(out.cpu(), want)
    assert (out.cpu() != blocks).sum() == len(set(chosen.tolist()) & set(guess[:n].tolist()))
    assert int(late) == 0 and int(ticks) == 1
    progress += 2                           # the next staging: 2 of its 3 programs done when the layer needs it
    up_addresses(chosen.to(DEV), guess.to(DEV), nt, blocks.to(DEV), dst, out, progress, ticks, late, 3)
    assert int(late) == 1 and int(ticks) == 2


def test_twin_addresses_from_a_shifted_guess_are_caught():
    """Must-fail twin: the addresses of a guess shifted by one rank differ from the staged rows'."""
    guess = torch.arange(10, 17)
    chosen = torch.tensor([12, 3, 16, 10])
    blocks = torch.arange(4) + (1 << 30)
    dst = torch.empty(7, 256, dtype=torch.uint8, device=DEV)
    out = torch.empty(4, dtype=torch.int64, device=DEV)
    z = [torch.zeros(1, dtype=torch.int64, device=DEV) for _ in range(3)]
    up_addresses(chosen.to(DEV), torch.roll(guess, 1).to(DEV), torch.tensor([7], dtype=torch.int32, device=DEV),
                 blocks.to(DEV), dst, out, *z, 1)
    assert not torch.equal(out.cpu(), up_addresses_torch(chosen, guess, 7, blocks, dst.data_ptr(), 256))
