"""The original's box, projected from this run's bytes per token and each part's measured rate.

    python -m bench.projection E2E.json [--moe-layers-target 40]
    python -m bench.projection E2E.json --instrument [--policy-json P.json --policy lru+prefetch
        --down-json D.json --active-groups 0.39 --sizes 16,8,4]

Rules (issue "Decode at its floor", part 5): memory-bound parts scale by bandwidth, instruction-bound parts by
SM count x clock; the expert bytes cross the target's bus at the fraction of H2D this run's kernels reached;
misses read from the target's NVMe at the fraction of the disk ceiling this run's pipeline reached. Both
"disk and bus overlapped" and "serial" are printed, with every assumption.

`--instrument` keeps the run's dense time, host time and the fractions of each ceiling its kernels and readers
reached, but takes the expert bytes from the trained instrument instead of the synthetic model (whose zeros and
routing are not a trained model's): the bus moves up + the share of down bytes the sparse kernel reads (the
instrument's active 16-groups, times what a sub-group size N reads against 16 on an instrument-like checkpoint),
and the disk reads what the cache policy reads on the instrument's routing trace (bench.policy_sim's replay,
prefetch reads included) at the share of Super's experts that the box's cache holds with N's block size.
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


SUPER = dict(L=1024, I=2688, n_experts=512, top_k=22, moe_layers=40)


def policy_at(rows: list[dict], label: str, fraction: float) -> dict:
    """Hit rate and reads per expert use of one policy_sim row label, interpolated linearly in cache fraction."""
    pts = sorted((r["fraction"], r) for r in rows
                 if r["policy"] + ("+prefetch" if r["prefetch"] else "") == label)
    if not pts:
        raise ValueError(f"no policy_sim rows labelled {label!r}")
    if not pts[0][0] <= fraction <= pts[-1][0]:
        raise ValueError(f"cache fraction {fraction:.3f} is outside the simulated {pts[0][0]}..{pts[-1][0]}")

    def per_use(r):
        return (r["demand_reads"] + r["prefetch_reads"]) / r["accesses"]
    for (f0, r0), (f1, r1) in zip(pts, pts[1:] + pts[-1:]):
        if f0 <= fraction <= f1:
            w = 0.0 if f1 == f0 else (fraction - f0) / (f1 - f0)
            return dict(hit_rate=r0["hit_rate"] + w * (r1["hit_rate"] - r0["hit_rate"]),
                        reads_per_use=per_use(r0) + w * (per_use(r1) - per_use(r0)))
    raise AssertionError("unreachable")


def down_ratios(d: dict, order: str = "identity") -> dict:
    """{N: down bytes at N / at 16 unordered} from a bench.down_groups json (rows), a bench.coactivation one or a
    tools.instrument_downbytes one (the NVFP4 store's ratios); `order` picks the neuron order of the last two
    (identity: as trained)."""
    if "rows" in d:
        if order != "identity":
            raise ValueError(f"a bench.down_groups json has no neuron orders (asked for {order!r})")
        return {str(r["down_group_neurons"]): r["down_vs_16"] for r in d["rows"]}
    if "bytes" in d:                    # tools.instrument_downbytes
        orders = d["bytes"]["nvfp4"]["vs_unordered_16"]
        if order not in orders:
            raise ValueError(f"order {order!r} not in the json's {sorted(orders)}")
        return orders[order]
    return next(o for o in d["orders"] if o["order"] == order)["down_vs_unordered_16"]


def instrument_projection(res: dict, policy_rows: list[dict], policy_label: str, down_vs_16: dict,
                          active_groups: float, sizes=(16, 8, 4), target: Box = RTX5060,
                          moe_layers_target: int = SUPER["moe_layers"]) -> list[dict]:
    """One projection per sub-group size N; see the module docstring. `down_vs_16[N]`: down bytes read at N over
    those read at 16 on an instrument-like checkpoint (scale copies included)."""
    from kernels.expert_block import ExpertGeometry
    m0 = res["projection_inputs"]
    run_layers = res["moe_layers"]
    uses_run = SUPER["top_k"] * run_layers          # expert uses per token in the run's layers
    out = []
    for n in sizes:
        g = ExpertGeometry(L=SUPER["L"], I=SUPER["I"], fmt="nvfp4", down_group_neurons=n)
        g16 = ExpertGeometry(L=SUPER["L"], I=SUPER["I"], fmt="nvfp4")
        up = g.sections()[0].nbytes + g.sections()[1].nbytes
        down_read = active_groups * g16.sections()[2].nbytes * float(down_vs_16[str(n)])
        experts_bytes = moe_layers_target * SUPER["n_experts"] * g.block_stride
        share = target.cache_gb * 1e9 / experts_bytes
        pol = policy_at(policy_rows, policy_label, share)
        m = dict(m0, pcie_bytes=uses_run * (up + down_read),
                 disk_bytes=uses_run * pol["reads_per_use"] * g.block_bytes)
        scale = moe_layers_target / run_layers
        p = project(m, target=target, layers_scale=scale)
        # the run's disk regime is not used here: the reads are the policy's on the instrument's trace
        p["assumptions"] = [x for x in p["assumptions"] if not x.startswith("misses from NVMe")]
        p["assumptions"].insert(2, f"misses from NVMe: {m['disk_bytes'] * scale / 1e6:.0f} MB/token at "
                                   f"{m['disk_fraction']:.0%} of {target.nvme_gbps} GB/s")
        published = project(dict(m, disk_bytes=m0["disk_bytes"] * g.block_bytes / g16.block_bytes),
                            target=target, layers_scale=scale)
        p["published_routing"] = dict(disk_bytes=m0["disk_bytes"] * g.block_bytes / g16.block_bytes * scale,
                                      ms=published["ms"], tps_overlapped=published["tps_overlapped"],
                                      tps_serial=published["tps_serial"])
        p["bus_bytes"], p["disk_bytes"] = m["pcie_bytes"] * scale, m["disk_bytes"] * scale
        p["assumptions"] = [
            f"N = {n}: block {g.block_bytes:,} B ({g.block_bytes / g16.block_bytes:.3f} x N=16); up {up:,} B read "
            f"whole; down read {down_read:,.0f} B per use = {active_groups:.0%} active 16-groups (the instrument) "
            f"x {float(down_vs_16[str(n)]):.3f} (N vs 16 on an instrument-like checkpoint)",
            f"cache: {target.cache_gb:g} GB of {experts_bytes / 1e9:.1f} GB of Super's experts = {share:.1%}; "
            f"{policy_label} on the instrument's trace at that share: hit {pol['hit_rate']:.1%}, "
            f"{pol['reads_per_use']:.3f} block reads per expert use (reads ahead included)",
            *p["assumptions"]]
        p.update(down_group_neurons=n, cache_share=share, **pol)
        out.append(p)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.projection", description=__doc__.split("\n\n")[0])
    ap.add_argument("e2e_json")
    ap.add_argument("--moe-layers-target", type=int, default=40)
    ap.add_argument("--instrument", action="store_true", help="expert bytes from the instrument (docstring)")
    ap.add_argument("--policy-json", default="bench/results/policy_sim-instrument.json")
    ap.add_argument("--policy", default="lru+prefetch", help="a policy_sim row label (the engine's: lru+prefetch)")
    ap.add_argument("--down-json", default="bench/results/down_groups-super1-coh045.json",
                    help="bench.down_groups (or bench.coactivation: its unordered row) output of an instrument-like "
                         "checkpoint: the down bytes at N against 16")
    ap.add_argument("--down-order", default="identity",
                    help="the neuron order whose ratios --down-json gives (bench.coactivation or tools.instrument_downbytes "
                         "output: identity, frequency, coact, ...)")
    ap.add_argument("--active-groups", type=float, default=0.39,
                    help="share of 16-neuron down groups with an active neuron (the instrument: docs/instrument.md)")
    ap.add_argument("--sizes", default="16,8,4")
    ap.add_argument("--json", help="write the projections here")
    a = ap.parse_args(argv)
    res = json.loads(open(a.e2e_json).read())
    if not a.instrument:
        m = res["projection_inputs"]
        p = project(m, layers_scale=a.moe_layers_target / res["moe_layers"])
        print_projection(p)
        return
    rows = json.loads(open(a.policy_json).read())["rows"]
    ps = instrument_projection(res, rows, a.policy, down_ratios(json.loads(open(a.down_json).read()), a.down_order), a.active_groups,
                               [int(x) for x in a.sizes.split(",")], moe_layers_target=a.moe_layers_target)
    print(f"inputs: {a.e2e_json} (dense, host, ceiling fractions), {a.policy_json} ({a.policy}), {a.down_json} "
          f"(down at N vs 16, order {a.down_order}), active 16-groups {a.active_groups:.0%}")
    for p in ps:
        print()
        print_projection(p)
    print("\nN | cache share | hit | reads/use | bus GB/tok | disk GB/tok | dense ms | bus ms | disk ms | host ms"
          " | tok/s overlapped | tok/s serial | with the run's (published-like) routing: disk GB/tok, tok/s overl.")
    for p in ps:
        ms, pub = p["ms"], p["published_routing"]
        print(f"{p['down_group_neurons']} | {p['cache_share']:.1%} | {p['hit_rate']:.1%} | {p['reads_per_use']:.3f} | "
              f"{p['bus_bytes'] / 1e9:.2f} | {p['disk_bytes'] / 1e9:.2f} | {ms['dense']:.1f} | {ms['bus']:.1f} | "
              f"{ms['disk']:.1f} | {ms['host']:.1f} | {p['tps_overlapped']:.2f} | {p['tps_serial']:.2f} | "
              f"{pub['disk_bytes'] / 1e9:.2f}, {pub['tps_overlapped']:.2f}")
    print("(the last column keeps the run's own disk reads: synthetic routing at --routing-skew 0.8, the published "
          "81-84 % concentration, scaled by the block size)")
    if a.json:
        open(a.json, "w").write(json.dumps(ps, indent=1) + "\n")


if __name__ == "__main__":
    main()
