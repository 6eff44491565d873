"""tools.gpu_compile: launches recorded under Triton's interpreter, compiled for sm_90 as the GPU's JIT specializes
them. The slab routing's kernels at the argument values that the decode gives them (the layer argument equal to 1
broke the GPU compile in session 19), and a must-fail twin: the kernel of that bug, caught only at the value 1."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

from tools.gpu_compile import has_cuda_backend

pytestmark = pytest.mark.skipif(not has_cuda_backend(), reason="Triton's NVIDIA backend (ptxas) is not installed")

CAPTURE_SLAB_KERNELS = """
import json, sys, torch
from tools.gpu_compile import Capture
from kernels import stage_ups as su
torch.manual_seed(0)
with Capture() as c:
    for layer, rows, programs, k in ((0, 4, 48, 22), (1, 1, 1, 1), (3, 7, 2, 5)):
        slab = torch.randint(0, 255, (9, 64), dtype=torch.uint8)
        table = slab.data_ptr() + torch.arange(9, dtype=torch.int64) * 64
        guess = torch.randperm(9)[:max(rows, 2)].to(torch.int64)
        n = torch.tensor([rows], dtype=torch.int32)
        dst = torch.zeros(rows, 64, dtype=torch.uint8)
        ids, owner, progress = (torch.zeros(rows, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                                torch.zeros(1, dtype=torch.int64))
        su.stage_ups(guess, n, table, dst, ids, owner, progress, layer, 48, programs)
        su.stage_late(progress, torch.zeros(1, dtype=torch.int64), programs)
        chosen = torch.randperm(9)[:k].to(torch.int64)
        su.up_addresses(chosen, ids, owner, table[chosen].clone(), dst, torch.zeros(k, dtype=torch.int64), progress,
                        layer)
json.dump(c.result(), open(sys.argv[1], "w"))
"""

CAPTURE_TWIN = """
import json, sys, torch
from tools.gpu_compile import Capture
from tests.tools import gpu_compile_twin_kernels as t
out = torch.zeros(1, dtype=torch.int64)
with Capture() as c:
    for layer in (0, 1, 2):
        t._owner_cast_kernel[(1,)](out, layer)
        t._owner_cast_varying_kernel[(1,)](out, layer)
    assert int(out) == 2
json.dump(c.result(), open(sys.argv[1], "w"))
"""


CAPTURE_BIG_TILES = """
import json, sys, torch
from tools.gpu_compile import Capture
from tests.tools import gpu_compile_twin_kernels as t
with Capture() as c:
    for block, block_k, stages in ((32, 32, 2), (256, 128, 4)):
        a, b = torch.randn(block, 2 * block_k).half(), torch.randn(2 * block_k, block).half()
        out = torch.zeros(block, block)
        t._tile_product_kernel[(1,)](a, b, out, 2 * block_k, BLOCK=block, BLOCK_K=block_k, num_stages=stages)
        assert torch.allclose(out, a.float() @ b.float(), atol=1e-2, rtol=1e-3)
json.dump(c.result(), open(sys.argv[1], "w"))
"""


CAPTURE_FMA_GEMV = """
import json, sys, torch
from tools.gpu_compile import Capture
from kernels import gemv_nvfp4 as g
from kernels.nvfp4 import encode_nvfp4
g._arch = lambda dev: 90
with Capture(execute=False) as c:           # recorded, not run: ~50 s a shape under the interpreter
    for e in sorted(k for k in g.GEMV_CHOICES if k[0] == 90 and "FMA" in g.GEMV_CHOICES[k]):
        cfg = g.gemv_config(e[1], e[2], e[3], torch.device("cpu"), n_sm=132)
        q, s, gs = encode_nvfp4(torch.randn(64, e[3]))
        g.nvfp4_linear(torch.randn(e[1], e[3]).bfloat16(), q, s, gs, out_dtype=torch.float32, config=cfg)
json.dump(c.result(), open(sys.argv[1], "w"))
"""


def _captured(tmp_path, script) -> dict:
    path = tmp_path / "launches.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-c", script, str(path)], env=env, cwd=ROOT, check=True, timeout=300)
    return json.loads(path.read_text())


def _compiled(tmp_path, captured) -> list[dict]:
    src, out = tmp_path / "in.json", tmp_path / "rows.json"
    src.write_text(json.dumps(captured))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    subprocess.run([sys.executable, "-m", "tools.gpu_compile", "--compile-child", str(src), "--out", str(out)],
                   env=env, cwd=ROOT, check=True, timeout=600)
    version, *rows = json.loads(out.read_text())
    assert version["triton"]
    return rows


def test_slab_kernels_compile_for_sm90_as_the_jit_specializes_them(tmp_path):
    captured = _captured(tmp_path, CAPTURE_SLAB_KERNELS)
    assert captured["undescribed"] == {}
    rows = _compiled(tmp_path, captured)
    assert [r for r in rows if r["ok"] is not True] == []
    kernels = {r["kernel"].split(":")[1] for r in rows}
    assert kernels == {"_stage_ups_kernel", "_stage_late_kernel", "_up_addresses_kernel"}
    # the launches with rows, programs and k equal to 1 made variants of their own (the JIT's constants)
    ups = [r for r in rows if r["kernel"].endswith("_stage_ups_kernel")]
    assert any(r["variant"].get("rows") == "('constexpr', 1)" for r in ups) and len(ups) >= 2
    # layer is never specialized: no variant names it
    assert not any("layer" in r["variant"] for r in rows)


def test_twin_int_made_constant_by_the_jit_is_caught(tmp_path):
    rows = _compiled(tmp_path, _captured(tmp_path, CAPTURE_TWIN))
    plain = [r for r in rows if r["kernel"].endswith(":_owner_cast_kernel")]
    varying = [r for r in rows if r["kernel"].endswith(":_owner_cast_varying_kernel")]
    # the plain kernel: a variant a value class (0: divisible by 16, 1: the constant, 2: neither); only the constant's
    # compile fails (an int constant has no .to), which the interpreter never sees
    failed = [r for r in plain if not r["ok"]]
    assert len(plain) == 3 and len(failed) == 1
    assert failed[0]["variant"]["layer"] == "('constexpr', 1)" and "'to'" in failed[0]["error"]
    assert [r["ok"] for r in varying] == [True]


def test_twin_shared_memory_over_the_block_limit_is_caught(tmp_path):
    """A variant that compiles but asks more shared memory than an sm_90 block may take fails at launch on the GPU:
    counted as failed; the small tile of the same kernel passes."""
    rows = _compiled(tmp_path, _captured(tmp_path, CAPTURE_BIG_TILES))
    assert len(rows) == 2
    small, big = sorted(rows, key=lambda r: r.get("shared", 0))
    assert small["ok"] is True and 0 < small["shared"] <= 232448
    assert big["ok"] is False and big["stage"] == "launch" and big["shared"] > 232448
    assert "OutOfResources" in big["error"]


def test_fma_gemv_production_variants_compile(tmp_path):
    """The GEMV entries routed to the FMA kernel (their C / R / PPS at Super's K), which the production-config test
    cannot afford to interpret: recorded without running and compiled, inline PTX (the GPU's HADD2) included."""
    captured = _captured(tmp_path, CAPTURE_FMA_GEMV)
    rows = _compiled(tmp_path, captured)
    fma = [r for r in rows if "gemv_nvfp4_fma" in r["kernel"]]
    assert fma and all(r["ok"] is True for r in rows)
    assert {r["variant"].get("C") for r in fma} == {"('constexpr', 4)"}
