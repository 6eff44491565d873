"""The batched chunked SSD scan (kernels/mamba_scan.py) against its loop twin and a float64 token-by-token
recurrence, on odd shapes; must-fail twins show the comparison catches a dropped chunk decay and a causal mask off
by one."""
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import mamba_scan
from kernels.mamba_scan import chunk_scan, chunk_scan_loop, scan_bytes
from kernels.testing import assert_close, rel_err

TOL = 1e-5      # fp32 both ways; measured ~1e-7


def inputs(T, nh, hd, N, ng, device, strong_decay=False, dtype_bc=torch.float32):
    x = torch.randn(T, nh, hd, device=device)
    dt = torch.rand(T, nh, device=device) * 0.5 + 0.01
    A = -(torch.rand(nh, device=device) * 3 + 0.1)
    if strong_decay:            # a chunk's summed decay far past exp's range (s_i - s_j > 88 above the diagonal)
        dt[:, 0] = 4.0
        A[0] = -8.0
    B = torch.randn(T, ng, N, device=device).to(dtype_bc)
    C = torch.randn(T, ng, N, device=device).to(dtype_bc)
    S0 = torch.randn(nh, hd, N, device=device)
    return x, dt, A, B, C, S0


def recurrence64(x, dt, A, B, C, S0):
    """Token by token in float64: state <- state exp(dt A) + dt x (x) B ; y = state . C."""
    x, dt, A, B, C, S = (t.double() for t in (x, dt, A, B, C, S0))
    rep = x.shape[1] // B.shape[1]
    B, C = B.repeat_interleave(rep, dim=1), C.repeat_interleave(rep, dim=1)
    ys = []
    for t in range(x.shape[0]):
        S = S * torch.exp(dt[t] * A)[:, None, None] + (dt[t][:, None] * x[t])[:, :, None] * B[t][:, None, :]
        ys.append(torch.einsum("hdn,hn->hd", S, C[t]))
    return torch.stack(ys), S


# (T, chunk, nh, hd, N, ng): T not a multiple of the chunk, T < chunk, T = one chunk, several whole chunks, one token
CASES = [(37, 16, 6, 5, 7, 3), (9, 16, 4, 3, 5, 2), (32, 32, 8, 4, 6, 8), (100, 8, 6, 4, 9, 1), (1, 8, 4, 2, 3, 2),
         (70, 32, 12, 3, 4, 4)]


@pytest.mark.parametrize("T,Q,nh,hd,N,ng", CASES)
def test_batched_scan_equals_loop_and_recurrence(T, Q, nh, hd, N, ng, device):
    x, dt, A, B, C, S0 = inputs(T, nh, hd, N, ng, device)
    S0_before = S0.clone()
    y, S = chunk_scan(x, dt, A, B, C, S0, Q)
    y_ref, S_ref = chunk_scan_loop(x, dt, A, B, C, S0, Q)
    assert torch.equal(S0, S0_before), "the scan must not modify the state it was given"
    assert y.shape == (T, nh, hd) and S.shape == (nh, hd, N) and y.dtype == S.dtype == torch.float32
    assert_close(y, y_ref, TOL, "y vs loop")
    assert_close(S, S_ref, TOL, "state vs loop")
    y64, S64 = recurrence64(x, dt, A, B, C, S0)
    assert_close(y, y64, TOL, "y vs float64 recurrence")
    assert_close(S, S64, TOL, "state vs float64 recurrence")


def test_pieces_carry_the_state(device):
    """Two calls, the second from the first's state, equal one call over both (what the mixer's pieces rely on)."""
    x, dt, A, B, C, S0 = inputs(75, 8, 4, 6, 2, device)
    y, S = chunk_scan(x, dt, A, B, C, S0, 16)
    y1, S1 = chunk_scan(x[:48], dt[:48], A, B[:48], C[:48], S0, 16)
    y2, S2 = chunk_scan(x[48:], dt[48:], A, B[48:], C[48:], S1, 16)
    assert_close(torch.cat([y1, y2]), y, TOL, "y over two pieces")
    assert_close(S2, S, TOL, "state over two pieces")


def test_decay_beyond_exp_range_stays_finite(device):
    """s_i - s_j above the diagonal overflows exp to inf; the masked result must still be finite and right."""
    x, dt, A, B, C, S0 = inputs(40, 4, 3, 5, 2, device, strong_decay=True)
    y, S = chunk_scan(x, dt, A, B, C, S0, 32)
    assert torch.isfinite(y).all() and torch.isfinite(S).all()
    y64, S64 = recurrence64(x, dt, A, B, C, S0)
    assert_close(y, y64, TOL, "y")
    assert_close(S, S64, TOL, "state")


def test_x_b_and_c_in_the_activation_dtype(device):
    """bf16 x, B and C (as the mixer passes them: strided slices of the conv output) read exactly as their fp32
    copies would be."""
    T, nh, hd, N, ng = 45, 8, 4, 8, 2
    _, dt, A, _, _, S0 = inputs(T, nh, hd, N, ng, device)
    xBC = torch.randn(T, nh * hd + 2 * ng * N, device=device).bfloat16()
    x, B, C = xBC.split([nh * hd, ng * N, ng * N], dim=-1)
    x, B, C = x.view(T, nh, hd), B.view(T, ng, N), C.view(T, ng, N)         # non-contiguous views
    y, S = chunk_scan(x, dt, A, B, C, S0, 16)
    assert y.dtype == torch.float32
    y_ref, S_ref = chunk_scan_loop(x.float(), dt, A, B.float(), C.float(), S0, 16)
    assert_close(y, y_ref, TOL, "y")
    assert_close(S, S_ref, TOL, "state")


def _decay_matrix_diagonal_dropped(acs_h, L):
    return torch.sub(acs_h[..., :, None], acs_h[..., None, :], out=L).exp_().tril_(-1)


def _carry_without_decay(states, S0, chunk_decay, S_in):
    return _carry_real(states, S0, torch.ones_like(chunk_decay), S_in)


_carry_real = mamba_scan._carry


@pytest.mark.parametrize("broken", ["diagonal", "carry"])
def test_broken_scans_are_caught(broken, device, monkeypatch):
    """Must-fail twins: the causal mask one off (a token's own input dropped), and the state carried from chunk to
    chunk without the chunk's decay. Each differs from the loop by far more than the tolerance."""
    if broken == "diagonal":
        monkeypatch.setattr(mamba_scan, "_decay_matrix", _decay_matrix_diagonal_dropped)
    else:
        monkeypatch.setattr(mamba_scan, "_carry", _carry_without_decay)
    x, dt, A, B, C, S0 = inputs(37, 6, 5, 7, 3, device)
    y, S = chunk_scan(x, dt, A, B, C, S0, 8)
    y_ref, S_ref = chunk_scan_loop(x, dt, A, B, C, S0, 8)
    assert rel_err(y, y_ref) > 100 * TOL
    if broken == "carry":
        assert rel_err(S, S_ref) > 100 * TOL


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(x=a["x"][:, :, None]), "x must be"),
    (lambda a: a.update(B=a["B"][:-1]), "B and C must"),
    (lambda a: a.update(A=a["A"][:-1]), "dt must be"),
    (lambda a: a.update(state=a["state"][:, :-1]), "state must be"),
    (lambda a: a.update(dt=a["dt"].bfloat16()), "fp32: dt"),
    (lambda a: a.update(x=a["x"].long()), "x must be a float"),
    (lambda a: a.update(chunk_size=0), "chunk_size"),
])
def test_bad_input_is_named(change, message, device):
    x, dt, A, B, C, S0 = inputs(10, 4, 3, 5, 2, device)
    args = dict(x=x, dt=dt, A=A, B=B, C=C, state=S0, chunk_size=4)
    change(args)
    with pytest.raises(ValueError, match=message):
        chunk_scan(**args)


def test_groups_must_divide_heads(device):
    x, dt, A, B, C, S0 = inputs(10, 6, 3, 5, 3, device)
    with pytest.raises(ValueError, match="6 heads do not split into 4 groups"):
        chunk_scan(x, dt, A, torch.randn(10, 4, 5), torch.randn(10, 4, 5), S0, 4)


class AllocatedBytes(TorchDispatchMode):
    """Bytes of the storages that the ops under it create and that some tensor still holds; `peak` their most.
    Storages of the tensors named at the start (the inputs) are not counted, nor are views of them."""

    def __init__(self, *inputs):
        super().__init__()
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs}
        self.holders, self.size, self.now, self.peak = {}, {}, 0, 0

    def _release(self, key):
        self.holders[key] -= 1
        if not self.holders[key]:
            del self.holders[key]
            self.now -= self.size.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in self.inputs:
                continue
            key = t.untyped_storage().data_ptr()
            if key not in self.holders:
                self.holders[key], self.size[key] = 0, t.untyped_storage().nbytes()
                self.now += self.size[key]
                self.peak = max(self.peak, self.now)
            self.holders[key] += 1
            weakref.finalize(t, self._release, key)
        return out


# Super's piece (512 tokens, 4 chunks of 128, 128 heads x 64 x 128, 8 groups) scaled down in heads, and shapes
# where other phases are the largest: small chunks (x-shaped products), a ragged tail, fewer tokens than a chunk
@pytest.mark.parametrize("T,Q,nh,hd,N,ng", [(512, 128, 16, 64, 128, 1), (333, 8, 16, 4, 128, 2), (300, 64, 16, 8, 16, 2),
                                            (20, 32, 8, 4, 8, 2), (130, 32, 4, 2, 64, 4),
                                            (100, 16, 8, 32, 4, 2)])
def test_scan_bytes_is_what_the_scan_allocates(T, Q, nh, hd, N, ng):
    """The memory model that the prefill budget uses equals the allocations counted op by op (CPU: no allocator
    rounding), output and new state included."""
    args = inputs(T, nh, hd, N, ng, "cpu")
    with AllocatedBytes(*args) as mem:
        y, S = chunk_scan(*args, Q)
    assert mem.now == y.nbytes + S.nbytes, "only the output and the new state outlive the scan"
    assert mem.peak == scan_bytes(T, nh, hd, ng, N, Q)


def test_scan_bytes_model_is_caught_when_wrong():
    """Must-fail twin: a model that forgets the decay matrices (the largest phase at Super's shape) is refused by
    the same comparison."""
    T, Q, nh, hd, N, ng = 512, 128, 16, 64, 128, 1
    args = inputs(T, nh, hd, N, ng, "cpu")
    with AllocatedBytes(*args) as mem:
        chunk_scan(*args, Q)
    assert mem.peak != scan_bytes(T, nh, hd, ng, N, Q) - 4 * (T // Q) * nh * Q * Q


@pytest.mark.parametrize("T,Q,nh,hd,N,ng", [c for c in CASES if c[0] > 2])
def test_taps_are_the_states_inside_the_piece(T, Q, nh, hd, N, ng):
    """chunk_scan's taps: the state after the first t tokens for t inside a chunk, on a chunk's start, in the ragged
    last chunk — each equal to the float64 recurrence stopped at t; y and the end state unchanged by asking.
    Must-fail twin: the state one token later, labelled t, is caught."""
    torch.manual_seed(T * 7 + Q)
    x, dt, A, B, C, S0 = inputs(T, nh, hd, N, ng, "cpu", dtype_bc=torch.bfloat16)
    want = sorted({1, min(Q, T - 1), T // 2, T - 1} | ({Q + 1} if Q + 1 < T else set()))
    taps = dict.fromkeys(want)
    y, S = chunk_scan(x, dt, A, B, C, S0, Q, taps=taps)
    y0, S_0 = chunk_scan(x, dt, A, B, C, S0, Q)
    assert torch.equal(y, y0) and torch.equal(S, S_0)
    for t in want:
        _, ref = recurrence64(x[:t], dt[:t], A, B[:t], C[:t], S0)
        assert rel_err(taps[t], ref.float()) < TOL, t
        _, late = recurrence64(x[:t + 1], dt[:t + 1], A, B[:t + 1], C[:t + 1], S0)
        assert rel_err(late.float(), ref.float()) > 100 * TOL, f"the state at {t + 1} passes for {t}: no proof"
    with pytest.raises(ValueError, match="inside"):
        chunk_scan(x, dt, A, B, C, S0, Q, taps={T: None})
