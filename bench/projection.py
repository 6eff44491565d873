"""The original's box, projected from this run's bytes per token and each part's measured rate.

    python -m bench.projection E2E.json [--moe-layers-target 40]

Rules (issue "Decode at its floor", part 5): memory-bound parts scale by bandwidth, instruction-bound parts by
SM count x clock; the expert bytes cross the target's bus at the fraction of H2D this run's kernels reached;
misses read from the target's NVMe at the fraction of the disk ceiling this run's pipeline reached. Both
"disk and bus overlapped" and "serial" are printed, with every assumption.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass


@dataclass
class Box:
    name: str
    hbm_gbps: float
    sms: int
    clock_ghz: float
    pcie_gbps: float
    nvme_gbps: float
    cache_gb: float


H200 = Box("H200 (this run)", 4800.0, 132, 1.98, 54.0, 1.2, 0.0)
RTX5060 = Box("RTX 5060 8 GB, PCIe 5.0 x8, NVMe 6 GB/s, 20 GB cache", 448.0, 30, 2.50, 26.0, 6.0, 20.0)


def project(m: dict, target: Box = RTX5060, source: Box = H200, layers_scale: float = 1.0,
            original_tps: float = 8.2) -> dict:
    """m: measured per-token figures of this run (see keys below), all for the run's MoE layers.
      dense_ms           GPU time of the dense stretch per token (Mamba, attention, routers, shared experts, lm_head)
      dense_bytes        bytes the dense part reads per token
      dense_hbm_fraction the fraction of HBM the dense kernels reached (< 0.5: instruction-bound, scale by SMs)
      pcie_bytes         expert bytes over the bus per token (RAM regime, measured by the kernels)
      pcie_fraction      the fraction of measured H2D the expert kernels reached
      disk_bytes         bytes read from disk per token with the cache at the target's share of the experts
      disk_fraction      the fraction of the disk ceiling the pipeline reached
      host_ms            host time per token not overlapped with the GPU (bookkeeping + launch gaps)"""
    s = layers_scale
    inst_bound = m["dense_hbm_fraction"] < 0.5
    if inst_bound:
        dense = m["dense_ms"] * (source.sms * source.clock_ghz) / (target.sms * target.clock_ghz)
        dense_rule = f"instruction-bound ({m['dense_hbm_fraction']:.0%} of HBM): x SMs*clock {source.sms}x{source.clock_ghz} / {target.sms}x{target.clock_ghz}"
    else:
        dense = m["dense_bytes"] / (target.hbm_gbps * 1e9 * m["dense_hbm_fraction"]) * 1e3
        dense_rule = f"memory-bound: {m['dense_bytes'] / 1e9:.2f} GB at {m['dense_hbm_fraction']:.0%} of {target.hbm_gbps} GB/s"
    bus = m["pcie_bytes"] * s / (target.pcie_gbps * 1e9 * m["pcie_fraction"]) * 1e3
    disk = m["disk_bytes"] * s / (target.nvme_gbps * 1e9 * m["disk_fraction"]) * 1e3
    host = m["host_ms"] * s
    dense_s = dense * s
    overlapped = max(dense_s + bus, disk) + host
    serial = dense_s + bus + disk + host
    return {
        "target": asdict(target), "layers_scale": s,
        "ms": {"dense": dense_s, "bus": bus, "disk": disk, "host": host},
        "tps_overlapped": 1e3 / overlapped, "tps_serial": 1e3 / serial, "original_tps": original_tps,
        "assumptions": [
            f"dense part: {dense_rule}, x{s:g} layers",
            f"experts over the bus: {m['pcie_bytes'] * s / 1e9:.2f} GB/token at {m['pcie_fraction']:.0%} of {target.pcie_gbps} GB/s",
            f"misses from NVMe: {m['disk_bytes'] * s / 1e6:.0f} MB/token at {m['disk_fraction']:.0%} of {target.nvme_gbps} GB/s "
            f"(cache share as in the run's disk regime)",
            f"host time not overlapped: {m['host_ms'] * s:.2f} ms/token (same CPU speed assumed)",
            "overlapped: disk reads run under dense + bus time; serial: one after the other",
        ],
    }


def print_projection(p: dict) -> None:
    print(f"projection to {p['target']['name']}:")
    for a in p["assumptions"]:
        print(f"  - {a}")
    ms = p["ms"]
    print(f"  ms/token: dense {ms['dense']:.1f}, bus {ms['bus']:.1f}, disk {ms['disk']:.1f}, host {ms['host']:.1f}")
    print(f"  => {p['tps_overlapped']:.1f} tok/s overlapped, {p['tps_serial']:.1f} tok/s serial "
          f"(the original: {p['original_tps']} tok/s)")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.projection", description=__doc__.split("\n\n")[0])
    ap.add_argument("e2e_json")
    ap.add_argument("--moe-layers-target", type=int, default=40)
    a = ap.parse_args(argv)
    res = json.loads(open(a.e2e_json).read())
    m = res["projection_inputs"]
    p = project(m, layers_scale=a.moe_layers_target / res["moe_layers"])
    print_projection(p)


if __name__ == "__main__":
    main()
