"""bench.kernels.stage_ups under the interpreter: the SM staging's rows are the slab's bytes (its GPU figures need a
GPU: bench/gpu_session.sh `stageb`)."""
import pytest
import torch

from bench.kernels import stage_ups as bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke run is the CPU's; a GPU runs the figures")
def test_the_smoke_run_stages_the_slab_bytes():
    res = bench.main([])
    assert res["alone"] and all(r["checked"] for r in res["alone"])
