"""The prefill conv1d kernel (kernels/mamba_conv.py) against its tap-by-tap twin on odd shapes, strided rows and
fewer tokens than the kernel is wide; must-fail twins: taps reversed, the state ignored."""
import json
import os
import subprocess
import sys

import pytest
import torch

from kernels.mamba_conv import causal_conv1d, causal_conv1d_torch
from kernels.testing import assert_close, rel_err


def inputs(T, C, K, dtype, device, extra_cols=0):
    wide = torch.randn(T, C + 2 * extra_cols, device=device).to(dtype)
    x = wide[:, extra_cols:extra_cols + C]                  # as the mixer passes it: a column slice of in_proj's out
    state = torch.randn(K - 1, C, device=device).to(dtype)
    return state, x, torch.randn(C, K, device=device), torch.randn(C, device=device)


@pytest.mark.parametrize("T,C,K", [(37, 70, 4), (2, 33, 4), (3, 130, 4), (50, 200, 3), (1, 17, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_equals_twin(T, C, K, dtype, device):
    state, x, w, b = inputs(T, C, K, dtype, device, extra_cols=5)
    before = state.clone()
    out, new = causal_conv1d(state, x, w, b)
    ref, new_ref = causal_conv1d_torch(state, x, w, b)
    assert torch.equal(state, before), "the old state must be left as it was"
    assert out.dtype == dtype and out.shape == (T, C) and out.is_contiguous()
    assert_close(out.float(), ref.float(), 1e-2 if dtype == torch.bfloat16 else 1e-5, "conv out")
    assert torch.equal(new, new_ref) and new.is_contiguous()
    assert new.untyped_storage().data_ptr() != x.untyped_storage().data_ptr(), "the state must not alias x"


def test_reversed_taps_are_caught(device):
    """Must-fail twin: the kernel fed its taps in the wrong order differs from the twin far beyond tolerance."""
    state, x, w, b = inputs(37, 70, 4, torch.float32, device)
    out, _ = causal_conv1d(state, x, w.flip(-1).contiguous(), b)
    ref, _ = causal_conv1d_torch(state, x, w, b)
    assert rel_err(out, ref) > 0.1


def test_ignored_state_is_caught(device):
    """Must-fail twin: a conv that starts from zeros instead of the state differs in the first K-1 rows."""
    state, x, w, b = inputs(6, 40, 4, torch.float32, device)
    out, _ = causal_conv1d(torch.zeros_like(state), x, w, b)
    ref, _ = causal_conv1d_torch(state, x, w, b)
    assert rel_err(out[:3], ref[:3]) > 0.1
    assert_close(out[3:], ref[3:], 1e-5, "rows past the state")


@pytest.mark.parametrize("args,message", [
    (lambda s, x, w, b: (s[:, :-1], x, w, b), "x must be"),
    (lambda s, x, w, b: (s, x, w[:, :-1], b), "w must be"),
    (lambda s, x, w, b: (s, x, w.double(), b), "fp32"),
    (lambda s, x, w, b: (s[:0], x, w[:, :1], b), "at least 2"),
    (lambda s, x, w, b: (s, x.t().contiguous().t(), w, b), "contiguous"),
])
def test_bad_input_is_named(args, message, device):
    state, x, w, b = inputs(8, 12, 4, torch.float32, device)
    for fn in (causal_conv1d, causal_conv1d_torch):
        with pytest.raises(ValueError, match=message):
            fn(*args(state, x, w, b))


def test_token_count_does_not_specialize():
    """The kernel compiles once per model, not once per prompt length (a compiled JIT object, built in a child
    process without the interpreter: no GPU needed)."""
    probe = ("import json; from kernels.mamba_conv import _conv_prefill_kernel as k; "
             "print(json.dumps(sorted(p.name for p in k.params if p.do_not_specialize)))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    assert set(json.loads(r.stdout.strip().splitlines()[-1])) >= {"T", "x_ptr"}
