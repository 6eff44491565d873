"""Seconds per image of the vision tower + projector streamed from pinned memory, beside the floors.

    python -m bench.vision_tower [--device cuda] [--out OUT.json] [--patches 1024,4096,13312]

Builds a tower of the released shape (C-RADIO ViT-H/16: hidden 1280, 32 blocks, 16 heads, MLP 5120, 128x128
position table, 10 prefix tokens; Nano Omni projector 5120 -> 20480 -> 2688) from random bf16 weights, no
checkpoint needed. In the same run it measures the ceilings: pinned host->device copy bandwidth, the bf16
matrix rate (a large GEMM) and the attention rate (SDPA at the largest image's shape). Then per image size:
  streamed : weights in pinned host memory, two device slots, next stage's copy overlapping this one's compute
  resident : every weight on the device (what streaming is compared against: it cannot beat it)
Floor = max(weight bytes / H2D bandwidth, FLOPs / matrix rate); a second, stricter compute figure prices the
attention FLOPs at the measured attention rate. Peak device memory of the streamed pass is reported beside the
estimate the compute process reserves (`VisionTower.activation_bytes` + the two slots). Table last; JSON out.
"""
from __future__ import annotations

import argparse
import json
import math
import time
import zlib

import torch

from gpu_worker.weight_stream import StreamedWeights
from nemotron import vision

# (gh, gw) per image size: 32x32, 64x64, and 104x128 = 13,312 (the released max_num_patches)
GRIDS = {1024: (32, 32), 4096: (64, 64), 13312: (104, 128)}


def released_config() -> vision.VisionConfig:
    return vision.VisionConfig(hidden_size=1280, num_layers=32, num_heads=16, mlp_hidden=5120, patch_size=16,
                               patch_dim=768, num_prefix_tokens=10, table_side=128, projector_hidden=20480,
                               out_hidden=2688)


class RandomTensors:
    """get/has over random tensors of the published names and shapes (bf16, scaled like trained weights)."""

    def __init__(self, cfg: vision.VisionConfig, seed: int = 0, device="cpu"):
        h, m, t = cfg.hidden_size, cfg.mlp_hidden, vision.TOWER
        shapes = {t + "patch_generator.embedder.weight": (h, cfg.patch_dim),
                  t + "patch_generator.pos_embed": (1, cfg.table_side ** 2, h),
                  t + "patch_generator.cls_token.token": (cfg.num_prefix_tokens, h),
                  vision.PROJECTOR + "0.weight": (4 * h,),
                  vision.PROJECTOR + "1.weight": (cfg.projector_hidden, 4 * h),
                  vision.PROJECTOR + "3.weight": (cfg.out_hidden, cfg.projector_hidden)}
        for i in range(cfg.num_layers):
            p = f"{t}blocks.{i}."
            shapes |= {p + "norm1.weight": (h,), p + "norm1.bias": (h,), p + "attn.qkv.weight": (3 * h, h),
                       p + "attn.qkv.bias": (3 * h,), p + "attn.proj.weight": (h, h), p + "attn.proj.bias": (h,),
                       p + "norm2.weight": (h,), p + "norm2.bias": (h,), p + "mlp.fc1.weight": (m, h),
                       p + "mlp.fc1.bias": (m,), p + "mlp.fc2.weight": (h, m), p + "mlp.fc2.bias": (h,)}
        self.shapes, self.seed, self.device = shapes, seed, device

    def has(self, name):
        return name in self.shapes

    def get(self, name):
        shape = self.shapes[name]
        g = torch.Generator(device=self.device).manual_seed(self.seed + zlib.crc32(name.encode()))
        x = torch.randn(shape, generator=g, device=self.device)
        if len(shape) == 1:
            x = (1 + 0.1 * x) if name.endswith("weight") else 0.02 * x
        elif len(shape) == 2 and "token" not in name:
            x = x / math.sqrt(shape[1])
        return x.to(torch.bfloat16).cpu()


def flops(cfg: vision.VisionConfig, n_patches: int) -> tuple[float, float]:
    """(matrix FLOPs, attention FLOPs) of one image through the tower and projector."""
    h, m, n = cfg.hidden_size, cfg.mlp_hidden, n_patches + cfg.num_prefix_tokens
    lin = 2 * n_patches * cfg.patch_dim * h + cfg.num_layers * 2 * n * (4 * h * h + 2 * h * m)
    lin += 2 * (n_patches // 4) * (4 * h * cfg.projector_hidden + cfg.projector_hidden * cfg.out_hidden)
    attn = cfg.num_layers * 4 * n * n * h
    return lin, attn


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def h2d_gbps(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    return nbytes / min(timed(lambda: dst.copy_(src, non_blocking=True), 5)) / 1e9


def gemm_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    a @ b
    return 2 * n ** 3 / min(timed(lambda: a @ b, 5)) / 1e12


def sdpa_tflops(cfg: vision.VisionConfig, n_patches: int) -> float:
    n = n_patches + cfg.num_prefix_tokens
    # 4-D (1, heads, N, head_dim) as the tower calls it: the flash kernel takes 4-D inputs only
    q, k, v = (torch.randn(1, cfg.num_heads, n, cfg.head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
    f()
    return 4 * n * n * cfg.hidden_size / min(timed(f, 5)) / 1e12


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--patches", default="1024,4096,13312")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="bench/results/vision_tower.json")
    a = ap.parse_args(argv)
    assert a.device.startswith("cuda"), "this benchmark needs a GPU"
    sizes = [int(x) for x in a.patches.split(",")]
    cfg = released_config()
    res = {"config": cfg.__dict__, "device": torch.cuda.get_device_name(), "sizes": {}}

    t = time.time()
    stages = vision.tower_stages(RandomTensors(cfg, device="cuda"), cfg, torch.bfloat16)
    res["weight_bytes"] = wbytes = sum(x.nbytes for s in stages for x in s.values())
    res["h2d_gbps"] = bw = h2d_gbps()
    res["gemm_tflops"] = rate = gemm_tflops()
    res["sdpa_tflops"] = {n: sdpa_tflops(cfg, n) for n in sizes}
    print(f"weights {wbytes / 1e9:.3f} GB in {len(stages)} stages (built in {time.time() - t:.1f} s); "
          f"H2D {bw:.1f} GB/s, GEMM {rate:.0f} TFLOP/s, SDPA {res['sdpa_tflops']}", flush=True)

    base = torch.cuda.memory_allocated()
    streamed = vision.VisionTower(cfg, StreamedWeights(stages, a.device), torch.bfloat16)
    res["slot_bytes"] = 2 * streamed.weights.slot_bytes
    resident = vision.VisionTower(cfg, vision.ResidentWeights(stages, a.device), torch.bfloat16)
    del stages
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in sizes:
        gh, gw = GRIDS.get(n) or (math.isqrt(n) // 2 * 2, n // (math.isqrt(n) // 2 * 2) // 2 * 2)
        pv, grid = torch.randn(gh * gw, 768, generator=g), torch.tensor([[gh, gw]])
        pv_dev = pv.cuda()

        def run(tower):
            tower._pos_cache.clear()          # each image pays its position-table resize, as a new size would
            with torch.inference_mode():
                return tower(pv_dev, grid)

        want = run(resident)
        got = run(streamed)
        same = all(torch.equal(x, y) for x, y in zip(got, want))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident_alloc = resident.weights.device_bytes
        ts = timed(lambda: run(streamed), a.reps)
        peak = torch.cuda.max_memory_allocated() - base - resident_alloc   # streamed pass: slots + activations
        tr = timed(lambda: run(resident), a.reps)
        lin, attn = flops(cfg, gh * gw)
        copy_floor = wbytes / (bw * 1e9)
        compute_floor = (lin + attn) / (rate * 1e12)
        strict_compute = lin / (rate * 1e12) + attn / (res["sdpa_tflops"][n] * 1e12)
        floor = max(copy_floor, compute_floor)
        r = {"grid": [gh, gw], "streamed_s": min(ts), "resident_s": min(tr), "streamed_all": ts, "resident_all": tr,
             "copy_floor_s": copy_floor, "compute_floor_s": compute_floor, "compute_floor_attn_rate_s": strict_compute,
             "floor_s": floor, "ratio": min(ts) / floor, "ratio_vs_resident": min(ts) / min(tr),
             "tflop": (lin + attn) / 1e12, "peak_vram_bytes": peak,
             "reserved_estimate_bytes": res["slot_bytes"] + streamed.activation_bytes(gh * gw),
             "bit_identical_to_resident": same}
        res["sizes"][n] = r
        rows.append((n, r))
        print(f"{n} patches: streamed {min(ts) * 1e3:.1f} ms, resident {min(tr) * 1e3:.1f} ms", flush=True)

    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\nvision tower + projector, bf16, {res['device']}; weights {wbytes / 1e9:.2f} GB; H2D {bw:.1f} GB/s; "
          f"GEMM {rate:.0f} TFLOP/s")
    print("| patches | streamed ms | resident ms | copy floor | compute floor (GEMM rate) | (attn at SDPA rate) "
          "| ratio to floor | vs resident | peak VRAM MB | reserved est. MB | bit-identical |")
    print("|" + " --- |" * 11)
    for n, r in rows:
        print(f"| {n} | {r['streamed_s'] * 1e3:.1f} | {r['resident_s'] * 1e3:.1f} | {r['copy_floor_s'] * 1e3:.1f} | "
              f"{r['compute_floor_s'] * 1e3:.1f} | {r['compute_floor_attn_rate_s'] * 1e3:.1f} | {r['ratio']:.2f} | "
              f"{r['ratio_vs_resident']:.2f} | {r['peak_vram_bytes'] / 2**20:.0f} | "
              f"{r['reserved_estimate_bytes'] / 2**20:.0f} | {r['bit_identical_to_resident']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
