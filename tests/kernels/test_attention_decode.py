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


@pytest.mark.parametrize("L,C,n_split", [(37, 64, 3), (1, 48, None), (48, 48, 2), (9, 130, None)])
def test_attention_decode_static_reads_only_the_filled_rows(L, C, n_split, device):
    """A buffer of capacity C with L rows filled and the length on the device (as a CUDA graph runs it): the twin
    over the first L rows; rows past L hold large garbage, which a twin that reads the whole buffer picks up."""
    from kernels.attention_decode import attention_decode_static
    nq, nkv, hd = 8, 2, 16
    q = torch.randn(nq, hd, device=device).bfloat16()
    k = (torch.randn(C, nkv, hd, device=device) * 4).bfloat16()
    v = (torch.randn(C, nkv, hd, device=device) * 4).bfloat16()
    length = torch.tensor([L], dtype=torch.int64, device=device)
    out = attention_decode_static(q, k, v, length, hd ** -0.5, n_split=n_split, block_s=16)
    ref = attention_decode_torch(q, k[:L], v[:L], hd ** -0.5)
    assert_close(out.float(), ref.float(), 1e-2, "static attn")
    if L < C:
        whole = attention_decode_torch(q, k, v, hd ** -0.5)
        assert (whole.float() - ref.float()).abs().max() > 0.1
    with pytest.raises(ValueError, match="length must be int64"):
        attention_decode_static(q, k, v, length.int(), hd ** -0.5)
