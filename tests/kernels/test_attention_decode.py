"""GQA attention decode (split-S) against its twin."""
import pytest
import torch

from kernels.attention_decode import attention_decode, attention_decode_torch
from kernels.testing import assert_close


@pytest.mark.parametrize("S,nq,nkv,hd,n_split", [(37, 32, 2, 32, 3), (5, 8, 2, 16, 1), (100, 6, 3, 16, None)])
def test_attention_decode(S, nq, nkv, hd, n_split, device):
    q = torch.randn(nq, hd, device=device).bfloat16()
    k = torch.randn(S, nkv, hd, device=device).bfloat16()
    v = torch.randn(S, nkv, hd, device=device).bfloat16()
    out = attention_decode(q, k, v, hd ** -0.5, n_split=n_split, block_s=16)
    ref = attention_decode_torch(q, k, v, hd ** -0.5)
    assert_close(out.float(), ref.float(), 1e-2, "attn")        # bf16 output
