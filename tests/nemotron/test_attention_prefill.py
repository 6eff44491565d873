"""Prefill attention as one fused SDPA launch (`Attention.attend_fused`, what CUDA runs) against the query-blocked
reference (`attend_blocks`, checked against transformers by test_model_vs_transformers): fresh random inputs, odd
sizes, GQA, with and without cached rows before the queries. On the CPU SDPA runs its own fused kernel, so the same
code path is compared here."""
import pytest
import torch
import torch.nn.functional as F

from nemotron.attention import Attention


def attn(nq, nkv, hd):
    a = Attention.__new__(Attention)
    a.nq, a.nkv, a.hd, a.scale = nq, nkv, hd, hd ** -0.5
    return a


@pytest.mark.parametrize("nq,nkv,hd", [(8, 2, 16), (6, 6, 32), (4, 1, 64)])
@pytest.mark.parametrize("T,past", [(1, 0), (7, 0), (37, 0), (5, 11), (29, 3), (1, 17)])
def test_fused_equals_blocked(nq, nkv, hd, T, past):
    g = torch.Generator().manual_seed(1000 * T + past + nq)
    S = T + past
    q, K, V = (torch.randn(n, h, hd, generator=g) for n, h in ((T, nq), (S, nkv), (S, nkv)))
    a = attn(nq, nkv, hd)
    fused = a.attend_fused(q, K, V, past)
    assert fused is not None, "no fused SDPA kernel on the CPU for fp32"
    torch.testing.assert_close(fused, a.attend_blocks(q, K, V, past), rtol=1e-5, atol=1e-5)


def test_bf16_within_rounding():
    g = torch.Generator().manual_seed(3)
    T, past, a = 45, 20, attn(8, 2, 64)
    q, K, V = (torch.randn(n, h, 64, generator=g).bfloat16() for n, h in ((T, 8), (T + past, 2), (T + past, 2)))
    fused = a.attend_fused(q, K, V, past)
    if fused is None:
        pytest.skip("no fused bf16 SDPA kernel on this CPU build")
    ref = a.attend_blocks(q.float(), K.float(), V.float(), past)
    assert (fused.float() - ref).abs().max() < 0.05


def test_top_left_causal_after_a_prefix_is_caught():
    """The must-fail twin: the causal mask aligned at the top left (right only without cached rows) differs from the
    reference once queries follow cached rows, so the comparison above would catch that mistake."""
    g = torch.Generator().manual_seed(5)
    T, past, a = 9, 6, attn(4, 2, 16)
    q, K, V = (torch.randn(n, h, 16, generator=g) for n, h in ((T, 4), (T + past, 2), (T + past, 2)))
    wrong = F.scaled_dot_product_attention(*(t.permute(1, 0, 2)[None] for t in (q, K, V)), is_causal=True,
                                           scale=a.scale, enable_gqa=True)[0].permute(1, 0, 2).reshape(T, -1)
    assert not torch.allclose(wrong, a.attend_blocks(q, K, V, past), atol=1e-3)


def test_sdpa_order_reads_the_knob(monkeypatch):
    """The backends in MOESTREAM_SDPA_ORDER's order (cuDNN last by default: it plans a graph per new shape); a name
    that is not a backend is an error naming it, not a silent default."""
    from torch.nn.attention import SDPBackend

    from nemotron.attention import sdpa_order
    monkeypatch.delenv("MOESTREAM_SDPA_ORDER", raising=False)
    assert sdpa_order() == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    monkeypatch.setenv("MOESTREAM_SDPA_ORDER", "cudnn, flash")
    assert sdpa_order() == [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
    monkeypatch.setenv("MOESTREAM_SDPA_ORDER", "flash,cudnnn")
    with pytest.raises(ValueError, match="cudnnn"):
        sdpa_order()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: the flash / cuDNN / efficient kernels")
@pytest.mark.parametrize("order", ["flash,efficient,cudnn", "flash", "efficient", "cudnn"])
@pytest.mark.parametrize("T,past", [(1000, 0), (333, 700)])
def test_fused_on_cuda_equals_blocked(T, past, order, monkeypatch):
    """Each backend alone on Super's attention shape (GQA 32:2, head 128, the lower-right mask after a prefix) equals
    the blocked reference (or takes no part: then the default order must still take it)."""
    monkeypatch.setenv("MOESTREAM_SDPA_ORDER", order)
    g = torch.Generator().manual_seed(T)
    a = attn(32, 2, 128)
    q, K, V = (torch.randn(n, h, 128, generator=g).cuda().bfloat16() for n, h in ((T, 32), (T + past, 2), (T + past, 2)))
    fused = a.attend_fused(q, K, V, past)
    if fused is None and "," not in order:
        pytest.skip(f"{order} does not take Super's attention shape here")
    assert fused is not None, "no fused SDPA kernel took Super's attention shape on this GPU"
    ref = a.attend_blocks(q.float(), K.float(), V.float(), past)
    assert (fused.float() - ref).abs().max() < 0.05
