"""The prefill kernels compile once per configuration, not once per prompt: their per-call ints and sliced pointers
are declared `varying` (kernels/backend.py). Checked on the compiled (not interpreted) JIT objects, in a child
process without TRITON_INTERPRET: no GPU is needed to build them."""
import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import json, triton
from kernels import expert_prefill as e
from kernels.backend import varying
out = {}
for name in ("_grouped_up_kernel", "_grouped_down_kernel", "_dequant_kernel", "_dense_up_kernel",
             "_dense_down_kernel", "_tma_up_kernel", "_tma_down_kernel"):
    k = getattr(e, name)
    out[name] = sorted(p.name for p in k.params if p.do_not_specialize)
from kernels import gemv_nvfp4 as g
for name in ("_nvfp4_gemm_kernel", "_fp8_gemm_kernel", "_nvfp4_gemv_kernel"):
    out[name] = sorted(p.name for p in getattr(g, name).params if p.do_not_specialize)
from kernels import expert_prefill_rega_gluon as r
for name in ("_rega_up_kernel_t", "_rega_down_kernel_t"):
    k = getattr(r, name)
    out[name] = sorted(p.name for p in k.params if p.do_not_specialize)
    out[name + "/aligned"] = sorted(p.name for p in k.params if p.do_not_specialize_on_alignment)
try:
    @triton.jit(**varying("no_such_argument"))
    def _k(x_ptr):
        pass
    out["typo"] = "accepted"
except Exception as exc:
    out["typo"] = type(exc).__name__
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def probe():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_per_prompt_arguments_do_not_specialize(probe):
    # the tile and slot counts change with every prompt; w/tok/table are slices at any row of the sorted tokens
    for name in ("_dense_up_kernel", "_tma_up_kernel"):
        assert {"n_tiles", "n_slots"} <= set(probe[name]), name
    for name in ("_dense_down_kernel", "_tma_down_kernel"):
        assert {"n_tiles", "n_slots", "w_ptr", "tok_ptr"} <= set(probe[name]), name
    assert {"n_tiles", "w_ptr", "tok_ptr"} <= set(probe["_grouped_down_kernel"])
    assert "n_tiles" in probe["_grouped_up_kernel"]


def test_the_rega_kernels_compile_once(probe):
    """The engine's Gluon kernels (the rega path): the tile count and the table change with every launch, the down's w
    and tok are slices at any row; h, the scales and the accumulator keep their alignment."""
    assert {"n_tiles", "table_ptr"} <= set(probe["_rega_up_kernel_t"])
    assert {"n_tiles", "table_ptr", "w_ptr", "tok_ptr"} <= set(probe["_rega_down_kernel_t"])
    assert {"w_ptr", "tok_ptr"} <= set(probe["_rega_down_kernel_t/aligned"])
    for name in ("_rega_up_kernel_t", "_rega_down_kernel_t"):
        assert not {"h_ptr", "gs_ptr", "acc_ptr"} & set(probe[name + "/aligned"]), name


def test_short_prompts_rows_do_not_specialize(probe):
    """A prompt of 9-127 tokens runs its projections through the tile-decoding GEMMs with M its length: one compile
    for every length (the API's first 126-token turn after a 128-token one compiled for 1.9-2.6 s, H200 session 17).
    The twin: the decode GEMV, whose M (1-8 rows) is meant to specialize, is caught as specializing."""
    for name in ("_nvfp4_gemm_kernel", "_fp8_gemm_kernel"):
        assert "M" in probe[name], name
    assert "M" not in probe["_nvfp4_gemv_kernel"]


def test_operands_keep_their_alignment(probe):
    # x and the weights are read in wide vector loads only where Triton knows they are 16-byte aligned
    for name in ("_dense_up_kernel", "_dense_down_kernel", "_grouped_up_kernel"):
        assert not {"x_ptr", "h_ptr", "wd_ptr"} & set(probe[name]), name


def test_a_misspelt_name_is_refused(probe):
    assert probe["typo"] != "accepted"
