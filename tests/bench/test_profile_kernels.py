"""bench.profile_kernels' arithmetic on a stand-in for torch.profiler's averages (the GPU run is the bench itself):
device rows only, divided per unit, grouped by family, busy time and launches summed; a kernel the patterns do not
name lands in "other"."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from bench.profile_kernels import family, kernel_table

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


class FakeProfile:
    def __init__(self, rows):
        self.rows = rows

    def key_averages(self):
        return [SimpleNamespace(key=k, device_type=d, self_device_time_total=us, count=n) for k, d, us, n in self.rows]


def test_families_name_the_engines_kernels():
    assert family("_vram_up_kernel") == "expert_up"
    assert family("_sparse_down_kernel") == family("_vram_down_kernel") == "sparse_down"
    assert family("_router_select_kernel") == "router"
    assert family("_nvfp4_gemv_kernel") == "gemv_nvfp4"
    assert family("nvjet_sm90_tst_512x8_64x3_2x1_v_bz_TNT") == "gemm (cuBLAS)"
    assert family("Memcpy HtoD (Pinned -> Device)") == "copies"
    assert family("_ssu_kernel") == "other"
    # the Mamba prefill's own kernels (the scan on the tensor cores, the carry, the conv)
    assert family("_ssd_state_kernel") == family("_ssd_out_kernel") == family("_carry_kernel") == "mamba"
    assert family("_conv_prefill_kernel") == "mamba"


def test_table_per_unit_by_family():
    prof = FakeProfile([
        ("_vram_up_kernel", CUDA, 160.0, 8),          # 2 units: 80 µs and 4 calls per unit
        ("_vram_down_kernel", CUDA, 120.0, 8),
        ("Memcpy HtoD (Pinned -> Device)", CUDA, 40.0, 20),
        ("_ssu_kernel", CUDA, 10.0, 2),
        ("aten::mm", CPU, 999.0, 50),                 # host rows are not device time
        ("idle", CUDA, 0.0, 3),                       # zero-time rows are dropped
    ])
    t = kernel_table(prof, per=2)
    assert t["kernels"]["_vram_up_kernel"] == (80.0, 4.0)
    assert list(t["kernels"])[0] == "_vram_up_kernel"          # sorted by device time
    assert "aten::mm" not in t["kernels"] and "idle" not in t["kernels"]
    assert t["families"]["expert_up"] == (80.0, 4.0)
    assert t["families"]["sparse_down"] == (60.0, 4.0)
    assert t["families"]["other"] == (5.0, 1.0)
    assert t["busy_us"] == 165.0 and t["launches"] == 19.0


def test_table_twin_that_forgets_the_unit_is_caught():
    prof = FakeProfile([("_vram_up_kernel", CUDA, 160.0, 8)])
    assert kernel_table(prof, per=2)["busy_us"] != kernel_table(prof, per=1)["busy_us"]
