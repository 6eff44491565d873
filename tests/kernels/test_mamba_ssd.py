"""kernels/mamba_ssd.py: the SSD scan on the tensor cores (Triton interpreted on the CPU) against its twin
(kernels.mamba_scan.chunk_scan + D·x) and a float64 token-by-token recurrence, on fresh random bf16 inputs of odd
shapes, strided as the mixer passes them; pieces, taps, decays past exp's range. Must-fail twins: one bf16 MMA
instead of the split (what the tolerance is there to catch), the carry without its decay, and a causal mask one off
(the reference without the token's own input)."""
from __future__ import annotations

import pytest
import torch

from kernels import backend, mamba_scan, mamba_ssd
from kernels.mamba_ssd import ssd_bytes, ssd_scan, ssd_scan_torch
from kernels.testing import assert_close, rel_err
from tests.kernels.test_mamba_scan import CASES, AllocatedBytes, recurrence64

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and not backend.interpreted(),
                                reason="needs a GPU or Triton's interpreter")

# the split's products are within ~2^-17 of fp32 on the GPU (round to nearest: ~3e-6 measured on the CPU model);
# Triton's interpreter truncates fp32 -> bf16, ~1e-5 here. One bf16 MMA (no split) is ~3e-3.
TOL = 3e-5


def inputs(T, nh, hd, N, ng, device, strong_decay=False):
    """x, B, C as bf16 views into one [T, nh·hd + 2·ng·N] conv output (the mixer's layout), fp32 dt, A, D, state."""
    xBC = torch.randn(T, nh * hd + 2 * ng * N, device=device).bfloat16()
    x, B, C = xBC.split([nh * hd, ng * N, ng * N], dim=-1)
    dt = torch.rand(T, nh, device=device) * 0.5 + 0.01
    A = -(torch.rand(nh, device=device) * 3 + 0.1)
    if strong_decay:            # a chunk's summed decay far past exp's range (s_i - s_j > 88 above the diagonal)
        dt[:, 0] = 4.0
        A[0] = -8.0
    D = torch.rand(nh, device=device) + 0.5
    S0 = torch.randn(nh, hd, N, device=device)
    return x.view(T, nh, hd), dt, A, B.view(T, ng, N), C.view(T, ng, N), D, S0


def reference64(x, dt, A, B, C, D, S0):
    y, S = recurrence64(x, dt, A, B, C, S0)
    return y + D.double()[:, None] * x.double(), S


# the scan tests' odd shapes, and Super's tiles (Q 128, hd 64, N 128: the blocks and warps the GPU compiles for it)
@pytest.mark.parametrize("T,Q,nh,hd,N,ng", CASES + [(150, 64, 4, 8, 16, 2), (45, 128, 4, 16, 32, 2),
                                                    (300, 128, 2, 64, 128, 1)])
def test_kernels_equal_twin_and_recurrence(T, Q, nh, hd, N, ng, device):
    args = inputs(T, nh, hd, N, ng, device)
    S0_before = args[-1].clone()
    y, S = ssd_scan(*args, Q)
    assert torch.equal(args[-1], S0_before), "the scan must not modify the state it was given"
    assert y.shape == (T, nh, hd) and S.shape == (nh, hd, N) and y.dtype == S.dtype == torch.float32
    y_t, S_t = ssd_scan_torch(*args, Q)
    assert_close(y, y_t, TOL, "y vs twin")
    assert_close(S, S_t, TOL, "state vs twin")
    y64, S64 = reference64(*args)
    assert_close(y, y64, TOL, "y vs float64 recurrence")
    assert_close(S, S64, TOL, "state vs float64 recurrence")


def test_pieces_carry_the_state(device):
    """Two calls, the second from the first's state, equal one call over both (the mixer's pieces)."""
    x, dt, A, B, C, D, S0 = inputs(75, 8, 4, 16, 2, device)
    y, S = ssd_scan(x, dt, A, B, C, D, S0, 16)
    y1, S1 = ssd_scan(x[:48], dt[:48], A, B[:48], C[:48], D, S0, 16)
    y2, S2 = ssd_scan(x[48:], dt[48:], A, B[48:], C[48:], D, S1, 16)
    assert_close(torch.cat([y1, y2]), y, TOL, "y over two pieces")
    assert_close(S2, S, TOL, "state over two pieces")


def test_decay_beyond_exp_range_stays_finite(device):
    """s_i - s_j above the diagonal overflows exp to inf; masked first, the result stays finite and right."""
    args = inputs(40, 4, 3, 5, 2, device, strong_decay=True)
    y, S = ssd_scan(*args, 32)
    assert torch.isfinite(y).all() and torch.isfinite(S).all()
    y64, S64 = reference64(*args)
    assert_close(y, y64, TOL, "y")
    assert_close(S, S64, TOL, "state")


def test_taps_are_the_states_inside_the_piece(device):
    """Taps inside a chunk, on a chunk's start, in the ragged last chunk: each the float64 recurrence stopped there;
    y and the end state unchanged by asking."""
    T, Q, nh, hd, N, ng = 37, 16, 6, 5, 7, 3
    x, dt, A, B, C, D, S0 = inputs(T, nh, hd, N, ng, device)
    want = [1, 5, 16, 17, 33, 36]
    taps = dict.fromkeys(want)
    y, S = ssd_scan(x, dt, A, B, C, D, S0, Q, taps=taps)
    y0, S_0 = ssd_scan(x, dt, A, B, C, D, S0, Q)
    assert torch.equal(y, y0) and torch.equal(S, S_0)
    for t in want:
        _, ref = recurrence64(x[:t], dt[:t], A, B[:t], C[:t], S0)
        assert rel_err(taps[t], ref) < TOL, t
    with pytest.raises(ValueError, match="inside"):
        ssd_scan(x, dt, A, B, C, D, S0, Q, taps={T: None})


def _carry_without_decay(states, S0, decay, S_in):
    return mamba_scan._carry(states, S0, torch.ones_like(decay), S_in)


def _reference_mask_one_off(x, dt, A, B, C, D, S0):
    """y_t from the state before token t's own input (the causal mask j < i instead of j <= i)."""
    x64, dt64, A64, B64, C64, S = (t.double() for t in (x, dt, A, B, C, S0))
    rep = x.shape[1] // B.shape[1]
    B64, C64 = B64.repeat_interleave(rep, dim=1), C64.repeat_interleave(rep, dim=1)
    ys = []
    for t in range(x.shape[0]):
        S = S * torch.exp(dt64[t] * A64)[:, None, None]
        ys.append(torch.einsum("hdn,hn->hd", S, C64[t]))
        S = S + (dt64[t][:, None] * x64[t])[:, :, None] * B64[t][:, None, :]
    return torch.stack(ys) + D.double()[:, None] * x64


@pytest.mark.parametrize("broken", ["one_mma", "carry", "mask"])
def test_broken_scans_are_caught(broken, device, monkeypatch):
    """Must-fail twins, each far outside the tolerance: the fp32 operands rounded to bf16 for one MMA (mamba_ssm's
    way: the split is what the tolerance holds), the state carried without the chunks' decay, and the kernel held
    against a reference whose causal mask is one off."""
    args = inputs(37, 6, 5, 7, 3, device)
    y64, S64 = reference64(*args)
    if broken == "mask":
        y, _ = ssd_scan(*args, 8)
        assert rel_err(y, y64) < TOL
        assert rel_err(y, _reference_mask_one_off(*args)) > 100 * TOL
        return
    if broken == "carry":
        monkeypatch.setattr(mamba_ssd, "_carry", _carry_without_decay)
    y, S = ssd_scan(*args, 8, config={"SPLIT": broken != "one_mma"})
    assert rel_err(y, y64) > 10 * TOL
    assert rel_err(S, S64) > 10 * TOL


def test_block_configs_agree(device):
    """The bench's other blocks (output rows of 32 / 128, columns of 16 / 64; the chunk states' N in blocks of 16)
    give the same y and state."""
    args = inputs(150, 4, 8, 40, 2, device)
    y, S = ssd_scan(*args, 64)
    for cfg in ({"BLOCK_I": 32, "BLOCK_J": 16}, {"BLOCK_I": 128, "BLOCK_J": 64}, {"state_block_n": 16}):
        y2, S2 = ssd_scan(*args, 64, config=cfg)
        assert_close(y2, y, TOL, str(cfg))
        assert_close(S2, S, TOL, str(cfg))


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(x=a["x"].float()), "x must be bf16"),
    (lambda a: a.update(B=a["B"].transpose(1, 2).contiguous().transpose(1, 2)), "B: its last two dims"),
    (lambda a: a.update(D=a["D"][:-1]), "D must be"),
    (lambda a: a.update(dt=a["dt"].bfloat16()), "fp32: dt"),
])
def test_bad_input_is_named(change, message, device):
    x, dt, A, B, C, D, S0 = inputs(10, 4, 3, 5, 2, device)
    args = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, state=S0, chunk_size=4)
    change(args)
    with pytest.raises(ValueError, match=message):
        ssd_scan(**args)


def test_on_by_default_on_cuda_in_bf16(device, monkeypatch):
    """Measured on the H200 (session 11): the kernels on CUDA with bf16 activations unless MOESTREAM_MAMBA_SSD=0;
    the twin on the CPU, in fp32, or where FORCED names it."""
    x = torch.zeros(2, 1, 1, device=device, dtype=torch.bfloat16)
    monkeypatch.setattr(backend, "FORCED", {})
    monkeypatch.delenv("MOESTREAM_MAMBA_SSD", raising=False)
    assert mamba_ssd.use_kernel(x) == (device == "cuda")
    assert not mamba_ssd.use_kernel(x.float())
    monkeypatch.setenv("MOESTREAM_MAMBA_SSD", "0")
    assert not mamba_ssd.use_kernel(x)
    monkeypatch.setenv("MOESTREAM_MAMBA_SSD", "1")
    assert mamba_ssd.use_kernel(x) == (device == "cuda")
    assert not mamba_ssd.use_kernel(x.float())
    monkeypatch.setattr(backend, "FORCED", {"mamba_ssd": "twin"})
    assert not mamba_ssd.use_kernel(x)
    monkeypatch.setattr(backend, "FORCED", {"mamba_ssd": "triton"})
    assert mamba_ssd.use_kernel(x) and not mamba_ssd.use_kernel(x.float())


@pytest.mark.parametrize("T,Q,nh,hd,N,ng", [(40, 16, 4, 16, 32, 2), (33, 8, 8, 4, 16, 2), (7, 16, 2, 4, 8, 1)])
def test_ssd_bytes_is_what_the_scan_allocates(T, Q, nh, hd, N, ng, device):
    """The memory model equals the allocations counted op by op (storage sizes, no allocator rounding); only y and
    the new state outlive the call."""
    args = inputs(T, nh, hd, N, ng, device)
    with AllocatedBytes(*args) as mem:
        y, S = ssd_scan(*args, Q)
    assert mem.now == y.nbytes + S.nbytes
    assert mem.peak == ssd_bytes(T, nh, hd, N, Q)
    assert ssd_bytes(4096, 128, 64, 128, 128) < mamba_scan.scan_bytes(4096, 128, 64, 8, 128, 128) / 2
