"""The one-launch norms against their twins (nemotron/norms.py), on fresh random rows of odd widths; must-fail
twins (a weight shifted by one channel, groups taken one channel off); the dispatch of nemotron.norms."""
import pytest
import torch

from kernels import backend
from kernels import rms_norm as k
from kernels.testing import assert_close, rel_err
from nemotron import norms


@pytest.mark.parametrize("rows,N,dtype", [(1, 1023, torch.bfloat16), (3, 4096, torch.bfloat16),
                                          (5, 96, torch.float32), (2, 1, torch.float32)])
def test_rms_norm_matches_twin(rows, N, dtype, device):
    x = (torch.randn(rows, N, device=device) * 3).to(dtype)
    w = torch.randn(N, device=device).to(dtype)
    got = k.rms_norm(x, w, 1e-5)
    ref = norms.rms_norm_torch(x, w, 1e-5)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert_close(got.float(), ref.float(), 1e-2 if dtype == torch.bfloat16 else 1e-5, "rms_norm")
    shifted = torch.roll(w, 1)
    assert rel_err(k.rms_norm(x, shifted, 1e-5).float(), ref.float()) > 0.1 or N == 1


@pytest.mark.parametrize("rows,N,G", [(1, 3 * 40, 40), (4, 2 * 1024, 1024), (2, 7, 7)])
def test_gated_group_rms_norm_matches_twin(rows, N, G, device):
    y = torch.randn(rows, N, device=device).bfloat16()
    z = torch.randn(rows, N, device=device).bfloat16()
    w = torch.randn(N, device=device)
    got = k.gated_group_rms_norm(y, z, w, G, 1e-6)
    ref = norms.gated_group_rms_norm_torch(y, z, w, G, 1e-6)
    assert got.dtype == torch.float32
    assert_close(got, ref, 1e-5, "gated norm")
    if N // G > 1:       # twin: groups one channel off are caught
        off = norms.gated_group_rms_norm_torch(torch.roll(y, 1, -1), torch.roll(z, 1, -1), w, G, 1e-6)
        assert rel_err(got, off) > 0.05


def test_bad_shapes_are_named(device):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match="weight has 7 elements"):
        k.rms_norm(x, torch.ones(7, device=device), 1e-5)
    with pytest.raises(ValueError, match="shapes do not agree"):
        k.gated_group_rms_norm(x, x, torch.ones(8, device=device), 3, 1e-5)


def test_norms_dispatch_to_the_kernel(device, monkeypatch):
    """nemotron.norms runs the kernel where kernels.backend says so (forced here), the twin otherwise."""
    x, w = torch.randn(2, 64, device=device), torch.randn(64, device=device)
    calls = []
    real = k.rms_norm
    monkeypatch.setattr(k, "rms_norm", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(backend, "FORCED", {"rms_norm": "triton"})
    assert_close(norms.rms_norm(x, w, 1e-5), norms.rms_norm_torch(x, w, 1e-5), 1e-5, "dispatch")
    monkeypatch.setattr(backend, "FORCED", {"rms_norm": "twin"})
    norms.rms_norm(x, w, 1e-5)
    assert calls == [1]


def test_rms_norm_into_a_given_buffer(device, monkeypatch):
    """`out=` (the decode graphs' static buffer): the kernel writes there, the twin copies there, same values; a
    buffer of the wrong shape is named."""
    x, w = torch.randn(1, 1023, device=device).bfloat16(), torch.randn(1023, device=device).bfloat16()
    ref = norms.rms_norm_torch(x, w, 1e-5)
    for path in ("triton", "twin"):
        monkeypatch.setattr(backend, "FORCED", {"rms_norm": path})
        out = torch.zeros_like(x)
        assert norms.rms_norm(x, w, 1e-5, out=out) is out
        assert_close(out.float(), ref.float(), 1e-2, f"rms_norm into out ({path})")
    with pytest.raises(ValueError, match="out is"):
        k.rms_norm(x, w, 1e-5, out=torch.zeros(1, 1022, device=device).bfloat16())
