"""The NVFP4 decode GEMV on the CUDA cores (bench/kernels/gemv_nvfp4_fma.py, session 12 h-gemv) against its PyTorch
twin `nvfp4_linear_torch`: odd N (1,023, 37, 5), K a multiple of 32 that is no multiple of the slice (partial chunks
and lanes past the slice), one and several K-slices (the split-K join), M = 1 and 2, rows per program that leave a
partial row block; must-fail twins (nibbles swapped, one scale group shifted) that the same check catches; the
inline-PTX decode string run on kernels.testing's model of the PTX against the e2m1 table for every byte.

Under the interpreter the kernel runs the same arithmetic as its PTX in plain Triton ops (fp16 pairs rounded after
every multiply-add, as HFMA2 rounds), so the tolerance is the fp16 math's (~1e-3), not the fp32 GEMV's 2e-5."""
import pytest
import torch

from bench.kernels import gemv_nvfp4_fma as f
from gemv_cases import activations as _x, counters_zero as _counters_zero, poisoned as _poisoned, weight as _weight
from kernels import gemv_nvfp4 as g
from kernels.nvfp4 import E2M1_VALUES, swap_nibbles
from kernels.testing import assert_close, fp16_value, rel_err, run_ptx

TOL = 4e-3      # fp16 products and sums: ~1e-3 measured here; a swapped nibble or a shifted group is > 0.1
N_SM = 4


@pytest.fixture(autouse=True)
def _four_sms(monkeypatch):
    monkeypatch.setattr(f, "_n_sm", lambda device: N_SM)


# (M, N, K, config): slices of C x 1,024 codes; K = 1,056 = 33 chunks of 32 codes
CASES = [
    (1, 1023, 1056, dict(C=1, R=8, num_warps=4, PPS=2)),        # 2 slices of 17 / 16 chunks: lanes past the slice
    (1, 37, 2080, dict(C=2, R=2, num_warps=1, PPS=1)),          # 2 slices, 5 programs of 8 rows: partial blocks
    (1, 5, 512, dict(C=1, R=1, num_warps=1, PPS=2)),            # one slice, half its lanes idle
    (2, 63, 1056, dict(C=2, R=8, num_warps=4, PPS=1)),          # one slice, M = 2, a partial row block
    (2, 37, 3104, dict(C=1, R=2, num_warps=2, PPS=3)),          # 4 slices, M = 2
    (1, 36, 4096, dict(C=4, R=4, num_warps=4, PPS=1)),          # the default C at M = 1, one slice
]


def _run(x, q, s, gs, cfg, device, **kw):
    return f.nvfp4_linear_fma(x, q, s, gs, out_dtype=torch.float32, config=cfg,
                              out=_poisoned(x.shape[0], q.shape[0], device), **kw)


@pytest.mark.parametrize("M,N,K,cfg", CASES)
def test_fma_matches_twin(M, N, K, cfg, device):
    q, s, gs = _weight(N, K, device, seed=N + K + M)
    x = _x(M, K, device, seed=M + N) * 30.0      # away from 1: the per-slice x scaling must undo itself
    ref = g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32)
    y = _run(x, q, s, gs, cfg, device)
    assert_close(y, ref, TOL, f"FMA GEMV {cfg}")
    assert _counters_zero(device), "arrival counters left non-zero for the next call"
    assert torch.equal(_run(x, q, s, gs, cfg, device), y), "a second call differs: the join is not deterministic"


@pytest.mark.parametrize("M,N,K,cfg", CASES[:2])
def test_fma_must_fail_twins(M, N, K, cfg, device):
    """The check above catches a decode with the nibbles swapped and the scales of one 16-group shifted by one."""
    q, s, gs = _weight(N, K, device, seed=7 + N)
    x = _x(M, K, device, seed=3)
    ref = g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32)
    assert rel_err(_run(x, swap_nibbles(q), s, gs, cfg, device), ref) > 0.1
    s_shift = s.view(torch.uint8).clone()
    s_shift[:, 1:] = s.view(torch.uint8)[:, :-1]
    assert rel_err(_run(x, q, s_shift.view(s.dtype), gs, cfg, device), ref) > 0.05


def test_decode_ptx_matches_e2m1_table():
    """DECODE_PTX on the PTX model: every byte value in every byte of a word gives pair q = (code q, code q + 4) as
    fp16 equal to e2m1 * 2^-14 exactly (subnormals included, signs and -0 kept)."""
    for b in range(256):
        for pos in range(4):
            r = b << (8 * pos)
            pairs = run_ptx(f.DECODE_PTX, [r])
            codes = [(r >> (4 * i)) & 15 for i in range(8)]
            for qi in range(4):
                lo, hi = fp16_value(pairs[qi]), fp16_value(pairs[qi] >> 16)
                assert lo == E2M1_VALUES[codes[qi]] * 2.0 ** -14, (hex(r), qi)
                assert hi == E2M1_VALUES[codes[qi + 4]] * 2.0 ** -14, (hex(r), qi)
                assert (pairs[qi] >> 15 & 1, pairs[qi] >> 31 & 1) == (codes[qi] >> 3, codes[qi + 4] >> 3)


def test_config_slices():
    c = f.fma_config(1, 18560, 4096, torch.device("cpu"), n_sm=132)
    assert (c["SLICES"], c["slice_w"], c["programs"]) == (1, 512, 395)          # 47 rows a program
    c = f.fma_config(1, 4096, 5376, torch.device("cpu"), dict(C=2), n_sm=132)
    assert (c["SLICES"], c["slice_w"]) == (3, 224)          # 1,792 codes a slice: 56 of 64 lanes' chunks
    with pytest.raises(ValueError):
        f.nvfp4_linear_fma(torch.zeros(1, 48), torch.zeros(3, 24, dtype=torch.uint8),
                           torch.zeros(3, 3, dtype=torch.uint8), 1.0)
