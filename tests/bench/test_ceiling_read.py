"""bench.kernels.common.ceiling_read's kernel (Triton interpreted on a CPU; on the GPU as it runs in the sweeps): it
reads every word of the trimmed buffer once (its sums equal torch's), and the ceiling comes out as a positive rate."""
import pytest
import torch

from bench.kernels import common


@pytest.mark.parametrize("block,programs", [(256, 3), (512, 2)])
def test_read_sum_reads_each_word_once(block, programs):
    src = torch.randint(-2**31, 2**31 - 1, (programs * block * 5 + 77,), dtype=torch.int32,    # a ragged tail
                        device=common.DEV)
    part, nb = common.read_sum(src, block, 4, programs)
    per = block * 5
    assert nb == programs * per * 4
    want = src[:programs * per].view(programs, per).to(torch.int64).sum(1)
    assert torch.equal(part.to(torch.int64).cpu() % 2**32, want.cpu() % 2**32)
    shifted = torch.roll(src, 1)     # the must-fail twin: other words read gives other sums
    assert not torch.equal(common.read_sum(shifted, block, 4, programs)[0], part)


def test_ceiling_read_smoke():
    assert common.ceiling_read(configs=[(1024, 4, 2)]) > 0
