"""One expert on a prefill chunk's tokens: the two GEMMs against the twin, the twin against dense weights."""
import pytest
import torch

from expert_cases import L, experts
from kernels.expert_prefill import expert_prefill, expert_prefill_torch
from kernels.moe_ops import block_addresses
from kernels.testing import assert_close


@pytest.mark.parametrize("T", [5, 37])
def test_expert_prefill_matches_twin(T, device):
    geom, blocks, ug, dg, ups, downs, _ = experts(k=2, device=device)
    x = torch.randn(T, L, device=device).bfloat16()
    tw = torch.rand(T, device=device) + 0.1
    y = expert_prefill(x, block_addresses(blocks, device), 1, geom, ug, dg, tw,
                       config=dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4))
    ref = expert_prefill_torch(x, blocks[1], geom, ug[1], dg[1], tw)
    # ReLU² outputs enter the down GEMM as fp16 (11-bit significand): ~2^-12 relative per element
    assert_close(y, ref, 1e-3, "prefill")
    dense = (torch.relu(x.float().cpu() @ ups[1].t()) ** 2 @ downs[1].t()) * tw.cpu()[:, None]
    assert_close(ref.cpu(), dense, 1e-5, "prefill twin vs dense")
