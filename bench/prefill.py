"""Time to first token of a prompt through the streaming engine, beside its floor, with the ceilings measured in
the same run; and the grouped expert prefill kernel against the GEMM and H2D ceilings.

    python -m bench.prefill --work DIR [--moe-layers 4] [--sizes 128,1000,4000,16000] [--out OUT.json]
                            [--profile] [--disk-reads as_slots_free,at_once]

One run (GPU; `super` shape, a few MoE layers, written to DIR/model once):
  ceilings  pinned host->device copy (H2D); bf16 GEMM (8192^3, random data); disk: demand reads through the
            pipeline itself (the same IO worker processes, queue depth and block size as a prompt's misses)
  kernel    the grouped launch at T tokens per expert: weights in VRAM, zero-copy from pinned memory, and staged
            by the copy engine into a device ring (both paths, the faster is the engine's)
  RAM       cache holds every expert (warmed); each prompt size, TTFT (prefill + first token on the host); weights
            staged (with the next MoE layer's guessed experts copied ahead while the dense layers run, whatever the
            engine's default), staged without the copies ahead (`staged_no_ahead`, the A/B), and zero-copy; the
            budget rows run with the engine's default
  disk      cache holds a third of the experts; each prompt size in turn (the cache keeps what earlier ones left),
            once per rule of --disk-reads (prefetcher/core.py: a prefill's reads wait for slots the prompt is done with,
            or, the rule before, every read gets a slot when queued)
  profile   (--profile) each RAM-regime prompt once more under gpu_worker.prefill_profile: ms per layer kind, the
            routed experts' share of it (waiting for the disk, grouped launches, staging copies); syncs at every
            layer boundary, so its TTFT is reported beside the plain one
  budget    (--budget-mb, 512 by default) the RAM regime's prompts of 1,000 tokens and more under that budget, as
            the server runs them: spans, TTFT, the measured peak against the estimate of the largest span
Each TTFT beside its floor = max(distinct expert bytes the prompt routes to / H2D, distinct expert bytes it routes
to that were not in the cache at its start / disk ceiling, FLOPs / GEMM rate): the bytes that must move once,
never the bytes the run happened to read. A ratio under 0.97 means the floor is wrong: it is not printed.
Prompts are windows of varied real text (bench/peers/texts.py) through the checkpoint's tokenizer, another window
for every run: a text's repeated tokens route unlike uniform random ids. In the RAM regime each size runs twice: the
first prompt of a size compiles the kernel configurations it needs (`TTFT cold`, printed apart), the second is the TTFT.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.ceilings import MIN_RATIO, pipeline_disk_gbps, ratio_or_note
from bench.envs import arm_env, env_pairs, scoped_env
from bench.io_trace import line as io_line, trace_summary

from bench.e2e_stream import copy_gbps, sh
from bench.workdir import warm_all




# ------------------------------------------------------------------ ceilings
def gemm_tflops(device, n=8192, reps=10) -> float:
    """bf16 on CUDA; on the CPU (a smoke run) fp32, the dtype the engine computes in there."""
    cuda = str(device).startswith("cuda")
    n = n if cuda else 1024
    dt = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dt)
    b = torch.randn(n, n, device=device, dtype=dt)
    for _ in range(3):
        a @ b
    sync(device)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        sync(device)
        ts.append(time.perf_counter() - t)
    return 2 * n ** 3 / float(np.median(ts)) / 1e12


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


# ------------------------------------------------------------------ the kernel
KERNEL_PATHS = ("rega", "dequant", "fused")


def kernel_bench(geom, device, gemm_rate, h2d, tokens_per_expert=(16, 64, 256, 512, 1024), n_experts=32) -> list[dict]:
    """The grouped launch over n_experts experts at T tokens each, as the engine chooses its path
    (`kernels.expert_prefill.grouped_path`), weights (a) in VRAM, (b) read zero-copy from pinned host memory, (c)
    staged: copied by the copy engine into a device ring, batch i+1's copy overlapping batch i's kernels; and each
    path the device takes forced, weights in VRAM (what the choice is made from). Every path is checked against the
    twin on these shapes before it is timed."""
    from kernels.expert_block import pack_expert_block
    from kernels.expert_prefill import expert_prefill_grouped, expert_prefill_grouped_torch, grouped_path, rega_able
    from kernels.nvfp4 import encode_nvfp4
    from kernels.testing import rel_err
    L, I, stride, bb = geom.L, geom.I, geom.block_stride, geom.block_bytes
    n_sets = 4       # rotate over several weight sets so that repeated launches do not measure the L2
    blk = []
    for _ in range(min(n_experts, 8)):
        uq, us, _ = encode_nvfp4(torch.randn(I, L))
        dq, ds, _ = encode_nvfp4(torch.randn(L, I))
        blk.append(pack_expert_block(geom, uq, us, dq, ds))
    from bench.kernels.common import HostSlab
    slab = HostSlab(n_sets * n_experts * stride)          # a registered /dev/shm mapping, as the engine's slab
    assert slab.registered, "cudaHostRegister failed: no zero-copy source"
    host = slab.tensor.view(n_sets * n_experts, stride)
    for i in range(host.shape[0]):
        host[i] = blk[i % len(blk)]
    vram = host.to(device)
    ring = torch.empty(2 * n_experts, stride, dtype=torch.uint8, device=device)
    ug = torch.full((n_experts,), 3e-3, device=device)
    dg = torch.full((n_experts,), 3e-3, device=device)
    rows, copy = [], torch.cuda.Stream()
    half_free = [torch.cuda.Event(), torch.cuda.Event()]     # the kernels that last read each half of the ring
    warmed = False
    for T in tokens_per_expert:
        M = T * n_experts
        segments = [(i * T, T) for i in range(n_experts)]
        xs = torch.randn(M, L, device=device).bfloat16()
        ws = torch.rand(M, device=device)
        tok = torch.randperm(M, device=device) % max(M // 4, 1)       # tokens routed to several experts
        acc = torch.zeros(max(M // 4, 1), L, device=device)
        h = torch.empty(M * I, dtype=torch.float16, device=device)
        flops = 2 * 2 * M * L * I
        paths = [p for p in KERNEL_PATHS if p != "rega" or rega_able(xs, geom)]
        res = dict(tokens_per_expert=T, experts=n_experts,
                   path_vram=grouped_path(xs, segments, geom, resident=True),
                   path_zero_copy=grouped_path(xs, segments, geom, resident=False))

        def run(src, i, path="auto", resident=False):
            base = src.data_ptr() + (i % n_sets) * n_experts * stride
            expert_prefill_grouped(xs, segments, [base + e * stride for e in range(n_experts)], geom, ug, dg, ws, tok,
                                   acc, h=h, path=path, resident=resident)

        # correctness on these shapes: each path against the twin (a few experts)
        k = 3
        ref = expert_prefill_grouped_torch(xs, segments[:k], [vram[e] for e in range(k)], geom, ug[:k], dg[:k], ws,
                                           tok, torch.zeros_like(acc))
        for path in paths:
            part = torch.zeros_like(acc)
            expert_prefill_grouped(xs, segments[:k], [vram[e].data_ptr() for e in range(k)], geom, ug[:k], dg[:k], ws,
                                   tok, part, h=h, path=path)
            res[f"rel_err_{path}"] = rel_err(part, ref)
        res["rel_err_vs_twin"] = max(res[f"rel_err_{p}"] for p in paths)
        if not warmed:          # the first timing of a process ran slow (session 41, call 1: 462 against 262 us)
            for path in paths:
                _median_time(lambda i: run(vram, i, path), 8)
            warmed = True
        for path in paths:
            sec = _median_time(lambda i: run(vram, i, path), 8)
            res[f"vram_{path}_us"] = sec * 1e6
            res[f"vram_{path}_fraction_of_gemm"] = flops / sec / 1e12 / gemm_rate
        for name, src, resident in (("vram", vram, True), ("zero_copy", host, False)):
            sec = _median_time(lambda i: run(src, i, resident=resident), 8)
            res[f"{name}_us"] = sec * 1e6
            res[f"{name}_tflops"] = flops / sec / 1e12
            res[f"{name}_weight_gbps"] = n_experts * bb / sec / 1e9

        def staged(i):
            half = i % 2
            r0 = half * n_experts
            copy.wait_event(half_free[half])          # batch i-2's kernels are done with this half
            with torch.cuda.stream(copy):
                ring[r0:r0 + n_experts].copy_(host[(i % n_sets) * n_experts:][:n_experts], non_blocking=True)
            torch.cuda.current_stream().wait_stream(copy)
            expert_prefill_grouped(xs, segments, [ring[r0 + e].data_ptr() for e in range(n_experts)], geom, ug, dg,
                                   ws, tok, acc, h=h, resident=True)
            half_free[half].record()
        sec = _median_time(staged, 8)
        res["staged_us"] = sec * 1e6
        res["staged_tflops"] = flops / sec / 1e12
        res["staged_weight_gbps"] = n_experts * bb / sec / 1e9
        res["vram_fraction_of_gemm"] = res["vram_tflops"] / gemm_rate
        res["zero_copy_fraction_of_h2d"] = res["zero_copy_weight_gbps"] / h2d
        res["staged_fraction_of_h2d"] = res["staged_weight_gbps"] / h2d
        res["faster_path"] = "staged" if res["staged_us"] < res["zero_copy_us"] else "zero_copy"
        rows.append(res)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}), flush=True)
    torch.cuda.synchronize()
    del host
    slab.close()
    return rows


SWEEP = [dict(X_LOAD=0, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
         dict(X_LOAD=1, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
         dict(X_LOAD=1, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
         dict(X_LOAD=1, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=2),
         dict(X_LOAD=0, BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)]


def kernel_sweep(geom, device, gemm_rate, tokens_per_expert=(256, 1024), n_experts=32) -> list[dict]:
    """Tile shapes and x loads of the grouped launch, weights in VRAM (llm.c style: every variant checked against
    the twin and timed; the winner becomes GROUPED_CONFIG)."""
    from kernels.expert_block import pack_expert_block
    from kernels.expert_prefill import expert_prefill_grouped, expert_prefill_grouped_torch
    from kernels.nvfp4 import encode_nvfp4
    from kernels.testing import rel_err
    L, I, stride = geom.L, geom.I, geom.block_stride
    uq, us, _ = encode_nvfp4(torch.randn(I, L))
    dq, ds, _ = encode_nvfp4(torch.randn(L, I))
    one = pack_expert_block(geom, uq, us, dq, ds)
    vram = one.to(device).repeat(4 * n_experts, 1)
    ug = torch.full((n_experts,), 3e-3, device=device)
    dg = torch.full((n_experts,), 3e-3, device=device)
    rows = []
    for T in tokens_per_expert:
        M = T * n_experts
        segments = [(i * T, T) for i in range(n_experts)]
        xs = torch.randn(M, L, device=device).bfloat16()
        ws = torch.rand(M, device=device)
        tok = torch.arange(M, device=device) % max(M // 4, 1)
        acc = torch.zeros(max(M // 4, 1), L, device=device)
        ref = expert_prefill_grouped_torch(xs, segments[:2], [vram[0], vram[1]], geom, ug[:2], dg[:2], ws, tok,
                                           torch.zeros_like(acc))
        for v, cfg in enumerate(SWEEP):
            row = dict(tokens_per_expert=T, variant=v, **cfg)
            try:
                part = torch.zeros_like(acc)
                expert_prefill_grouped(xs, segments[:2], [vram[0].data_ptr(), vram[1].data_ptr()], geom, ug[:2],
                                       dg[:2], ws, tok, part, config=cfg)
                row["rel_err"] = rel_err(part, ref)
                sec = _median_time(lambda i: expert_prefill_grouped(
                    xs, segments, [vram[(i % 4) * n_experts + e].data_ptr() for e in range(n_experts)], geom, ug, dg,
                    ws, tok, acc, config=cfg), 6, reps=3)
                row["us"] = sec * 1e6
                row["tflops"] = 2 * 2 * M * L * I / sec / 1e12
                row["fraction_of_gemm"] = row["tflops"] / gemm_rate
            except Exception as e:        # a shape the compiler cannot fit (shared memory) is a result too
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print("sweep", json.dumps({k: (round(x, 4) if isinstance(x, float) else x) for k, x in row.items()}),
                  flush=True)
    return rows


def _median_time(fn, n, reps=5) -> float:
    for i in range(2):
        fn(i)
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for i in range(n):
            fn(i)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3 / n)
    return float(np.median(ts))


# ------------------------------------------------------------------ floors
def text_ids(tokenizer, corpus: str, vocab: int, n: int, seed: int = 1000) -> list[int]:
    """n token ids of a window of varied real text (bench/peers/texts.py), another window per (n, seed)."""
    from bench.peers import texts
    ids = [t for t in tokenizer.encode(texts.prompt_of_tokens(corpus, tokenizer, n, seed + n),
                                       add_special_tokens=False).ids if t < vocab][:n]
    rng = np.random.default_rng(seed + n)       # a short text window: padded with more of the text
    while len(ids) < n:
        more = tokenizer.encode(texts.prompts(corpus, 1, 4 * (n - len(ids)) + 64, int(rng.integers(1 << 30)))[0],
                                add_special_tokens=False).ids
        ids += [t for t in more if t < vocab][:n - len(ids)]
    return ids


def prefill_flops(cfg, T: int, expert_uses: int, past: int = 0) -> float:
    """Multiply-adds x 2 of one prefill of T tokens: the dense linears per token, attention over the causal
    prefix, the Mamba2 scan's chunk products, the routed experts (per (token, expert) use), one lm_head row."""
    from nemotron.config import ATTENTION, MAMBA, MLP, MOE
    H = cfg.hidden_size
    per_token = 0.0
    attn = 0.0
    for kind in cfg.layer_types:
        if kind == MAMBA:
            I, conv, nh = cfg.mamba_intermediate, cfg.conv_dim, cfg.mamba_num_heads
            per_token += 2 * H * (I + conv + nh) + 2 * I * H
            Q, N, hd = cfg.chunk_size, cfg.ssm_state_size, cfg.mamba_head_dim
            per_token += 2 * nh * (Q * (N + hd) + 2 * hd * N)
        elif kind == ATTENTION:
            nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            per_token += 2 * H * (nq + 2 * nkv) * hd + 2 * nq * hd * H
            attn += 4 * nq * hd * (T * past + T * (T + 1) / 2)
        elif kind == MOE:
            Lat = cfg.moe_latent_size or H
            per_token += 2 * H * cfg.n_routed_experts
            if cfg.moe_latent_size:
                per_token += 2 * 2 * H * Lat
            if cfg.n_shared_experts:
                per_token += 2 * 2 * H * cfg.moe_shared_expert_intermediate_size
        elif kind == MLP:
            per_token += 2 * 2 * H * cfg.intermediate_size
    Lat = cfg.moe_latent_size or H
    experts = expert_uses * 4 * Lat * cfg.moe_intermediate_size
    return T * per_token + attn + experts + 2 * H * cfg.vocab_size


def resident(eng) -> set:
    from cache_shm.shm import READY
    shm = eng.sup.shm
    E = shm.n_experts
    return {(int(k) // E, int(k) % E) for k, st in zip(shm.slot_key, shm.slot_state) if k >= 0 and st == READY}


# ------------------------------------------------------------------ one prompt
def ttft(eng, ids, device) -> dict:
    from gpu_worker.prefill import default_budget, prefill, span_bytes, span_plan
    m = eng.model
    plan = span_plan(m.config, m.dtype, default_budget(m.device), m.device)    # the pieces prefill() will take
    before = resident(eng)
    forced0 = eng.cache_stats()["prefill_forced"]
    cuda = str(device).startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        mem0 = torch.cuda.memory_allocated()
    t, t_ns = time.perf_counter(), time.monotonic_ns()
    logits = prefill(m, ids, m.new_state())
    tok = int(logits[-1].argmax())          # the first token, on the host
    sec = time.perf_counter() - t
    window_ns = (t_ns, time.monotonic_ns())     # the IO workers' trace clock (bench.io_trace's windows)
    peak = torch.cuda.max_memory_allocated() - mem0 if cuda else 0
    last = eng.experts.prefill_acct.last
    routed = eng.experts.prefill_acct.routed_keys()
    # tier_resident: routed experts the VRAM tier held, whose bytes need not cross the bus (read there or not:
    # MOESTREAM_PREFILL_TIER=0's rows keep the same floor)
    held = eng.experts.vram.slot_of if eng.experts.vram is not None else {}
    return dict(tokens=len(ids), ttft_s=sec, first_token=tok, distinct_experts=len(routed),
                tier_resident=last.tier_resident, tier_read=last.tier_read, **ahead_figures(last),
                missing_at_start=len(routed - before),
                # of those, not in the VRAM tier either: what must come from the disk
                missing_not_in_tier=sum(1 for k in routed - before if k not in held),
                expert_uses=last.expert_uses, window_ns=window_ns,
                forced_reads=eng.cache_stats()["prefill_forced"] - forced0,
                blocks_read=last.blocks_read, prefetch_wasted=last.prefetch_wasted, bytes_from_disk=last.bytes_from_disk,
                bytes_over_pcie=last.bytes_over_pcie, launches=last.launches, launches_rega=last.launches_rega,
                launches_indexed=last.launches_indexed, ms_waiting_for_disk=last.ms_waiting_for_disk,
                tokens_per_s=len(ids) / sec,
                peak_bytes=peak, piece_tokens=plan.pieces.tokens, mamba_piece_tokens=plan.pieces.mamba_tokens,
                estimated_bytes=span_bytes(m.config, m.dtype, len(ids), plan=dataclasses.replace(
                    plan, ahead_bytes=eng.experts.ahead_bytes, launch_bytes=eng.experts.launch_bytes)))


def fill_tier(eng, nbytes: int, device, store) -> None:
    """A VRAM tier of `nbytes` beside the engine (as the server's --vram-gb leaves one), filled as decode would leave
    it warm: with randomly chosen experts of every MoE layer (the synthetic router has no favourites; the same ones in
    every engine of a run), copied from the slab where the RAM cache holds them, else read from the store. Its
    residents stay for the regime's rows."""
    used = torch.cuda.memory_allocated() if str(device).startswith("cuda") else eng.model.dense_nbytes()
    vt = eng.experts.vram = eng._vram_tier(used + nbytes, 0, device, 2)
    src, shm = eng.experts, eng.sup.shm
    keys = [(j, e) for j in range(src.n_moe) for e in range(shm.n_experts)]
    rng = np.random.default_rng(41)
    for i in rng.permutation(len(keys))[:vt.n_slots].tolist():
        j, e = keys[i]
        slot = int(shm.slot_of_expert[j, e])
        vt.admit(j, e, src.slab[slot, :src.block_bytes] if slot >= 0 else torch.from_numpy(store.read_block(j, e)))
    vt.settle(wait=True)
    print(f"VRAM tier: {len(vt.slot_of)} experts of {len(keys)} ({vt.nbytes >> 20} MiB)", flush=True)


def ahead_figures(last) -> dict:
    """The copies ahead of one prompt (gpu_worker/prefill_experts.py `_copy_ahead`) and how right the guess was:
    precision, the guess's experts the layer routed to; recall, the layer's routed experts the guess named; the next
    layers' guesses' precision by how many tokens they guessed for an expert, and how many they named so."""
    from gpu_worker.prefill_accounting import GUESS_TOKEN_BUCKETS
    return dict(ahead_copied=last.ahead_copied, ahead_used=last.ahead_used, ahead_read=last.ahead_read,
                ahead_wrong=last.ahead_wrong, bytes_copied_ahead=last.bytes_copied_ahead,
                ms_issuing_ahead=last.ms_issuing_ahead, ms_host_moe=last.ms_host_moe,
                ms_host_launching=last.ms_host_launching, ms_host_staging=last.ms_host_staging,
                ms_router_sync=last.ms_router_sync, ms_to_inputs=last.ms_to_inputs,
                ms_to_first_copy=last.ms_to_first_copy, ahead_lent=last.ahead_lent, lent_evicted=last.lent_evicted,
                lent_restored=last.lent_restored,
                bytes_wasted_ahead=last.ahead_wrong * (last.bytes_copied_ahead // max(last.ahead_copied, 1)),
                guess_precision=last.guess_right / max(last.guess_named, 1),
                guess_recall=last.guess_right / max(last.guess_layer_routed, 1),
                guess_precision_by_tokens=last.guess_precision_by_tokens(),
                guess_named_by_tokens={b: getattr(last, f"guess_named_t{b}") for b in GUESS_TOKEN_BUCKETS})


def budgeted(eng, ids, device, budget: int, reps: int = 3) -> dict:
    """One prompt under a stated budget, as the server runs it (`--vram-gb`: the engine's reserve is the prefill's
    budget): its spans, the measured peak beside the budget and beside the model's estimate of its largest span
    (gpu_worker/prefill.py, with the plan and the KV capacities each span was planned with). TTFT: the median of
    `reps` runs (one run was session 8's first figure, and moved by 35 % between two rows of the same plan)."""
    from gpu_worker.prefill import kv_rows, prefill, span_bytes, span_plan
    m = eng.model
    plan = span_plan(m.config, m.dtype, budget, m.device)
    prefill(m, ids[::-1], m.new_state(), budget_bytes=budget)     # the launches of this budget compiled: untimed
    spans, est, fwd = [], 0, m.forward

    def spy(part, state, *a, **kw):
        nonlocal est
        with_ahead = dataclasses.replace(plan, ahead_bytes=eng.experts.ahead_budget_bytes,   # as set for this span
                                         launch_bytes=eng.experts.launch_bytes)    # (slots lent by a tier: not it)
        est = max(est, span_bytes(m.config, m.dtype, len(part), state.position, plan=with_ahead,
                                  kv_rows=kv_rows(state)))
        spans.append(len(part))
        return fwd(part, state, *a, **kw)
    cuda = str(device).startswith("cuda")
    m.forward = spy
    try:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            mem0 = torch.cuda.memory_allocated()
        secs = []
        for _ in range(max(1, reps)):
            if spans:
                spans.clear()
            t = time.perf_counter()
            logits = prefill(m, ids, m.new_state(), budget_bytes=budget)
            tok = int(logits[-1].argmax())
            secs.append(time.perf_counter() - t)
            del logits
        sec = sorted(secs)[len(secs) // 2]
        peak = torch.cuda.max_memory_allocated() - mem0 if cuda else 0
    finally:
        del m.forward
    last = eng.experts.prefill_acct.last
    return dict(tokens=len(ids), budget_bytes=budget, spans=spans, first_token=tok, ttft_s=sec, ttft_runs_s=secs,
                # (what the floor counts: `with_floor`, as the unbudgeted rows')
                distinct_experts=last.distinct_experts, tier_resident=last.tier_resident,
                missing_at_start=last.missing_at_start, missing_not_in_tier=last.missing_not_in_tier,
                expert_uses=last.expert_uses,
                **ahead_figures(last), ahead_slot_bytes=eng.experts.ahead_bytes,
                tokens_per_s=len(ids) / sec, launches=last.launches, launches_fused=last.launches_fused,
                launches_rega=last.launches_rega,
                launches_indexed=last.launches_indexed, peak_bytes=peak, estimated_bytes=est,
                plan=dict(piece_tokens=plan.pieces.tokens, mamba_piece_tokens=plan.pieces.mamba_tokens,
                          score_bytes=plan.pieces.score_bytes, launch_bytes=plan.launch()),
                peak_within_estimate=peak <= est, estimate_within_budget=est <= budget)


def profiled(eng, ids, device, budget: int | None = None) -> dict:
    """The same prompt once more under the per-stage profile (gpu_worker/prefill_profile.py), under `budget` if
    given (the budget rows with --profile)."""
    from gpu_worker.prefill import prefill
    from gpu_worker.prefill_profile import PrefillProfile
    m = eng.model
    with PrefillProfile(m) as prof:
        logits = prefill(m, ids, m.new_state(), budget_bytes=budget)
        int(logits[-1].argmax())
    return prof.result()


def path_parts(path: str) -> tuple[str, str, str, bool]:
    """A --paths entry BASE[@N][+|-][!][#k] as (base, pieces N or "", glue "+" / "-" / "", runs): "#k" only names a
    repeat, "@N" the largest piece, "+" / "-" the new / old glue, "!" the copies ahead a block at a time (in runs by
    default since session 9); "|KEY=VAL" (`path_env`) is read apart."""
    p = path.split("#")[0].split("|")[0].split("~")[0]
    runs = p.endswith("!")
    p = p.rstrip("!")
    glue = p[-1] if p.endswith(("+", "-")) else ""
    base, _, piece = p.rstrip("+-").partition("@")
    return base, piece, glue, runs


def ahead_gate(path: str) -> int | None:
    """A --paths entry's "~G": the copies ahead for prompts of G tokens and more (the engine's
    `ahead_min_tokens`, MOESTREAM_PREFILL_AHEAD_MIN_TOKENS; 0 by default since session 15); None without one."""
    g = path.split("#")[0].split("|")[0].partition("~")[2]
    return int(g) if g else None


def path_env(path: str) -> dict[str, str]:
    """A --paths entry's "|KEY=VAL" parts (before any "#k"): environment switches set for that path's prompts only,
    e.g. staged|MOESTREAM_MAMBA_SSD=1 (an engine switch read per call, A/B'd in one process)."""
    return env_pairs(path.split("#")[0].split("|")[1:], f"--paths entry {path!r}")


def new_glue(path: str) -> None:
    """The glue's A/B by a path's last character: "+" session 7's glue (on by default since session 8), "-" the old —
    the Mamba scan's carry in one launch (kernels/mamba_carry.py) and the staging ring's adjacent blocks in one copy
    (gpu_worker/slab_copies.py `copy_runs`); neither: the engine's defaults."""
    for name in ("MOESTREAM_MAMBA_CARRY_KERNEL", "MOESTREAM_COPY_RUNS"):
        if path.endswith(("+", "-")):
            os.environ[name] = "1" if path.endswith("+") else "0"
        else:
            os.environ.pop(name, None)


def rounds(res) -> list[dict]:
    """Each regime's paths repeated as PATH#k, gathered by (regime, path without "#k", prompt size): the rounds' TTFTs
    in run order, their median and minimum, and both against the regime's first path at that size (what an A/B is
    decided on: one round moves ±10 ms at 16k on a slow host, bench/NOTES.md session 25; the minimum also drops a
    round that compiled). A path run once is a group of one."""
    out = []
    for name in [k for k in res if k == "ram" or k.startswith("disk")]:
        groups: dict[tuple[str, int], list[dict]] = {}
        for path, rows in res[name].items():
            for r in rows:
                groups.setdefault((path.split("#")[0], r["tokens"]), []).append(r)
        first: dict[int, dict] = {}
        for (path, tokens), rows in groups.items():
            ms = [r["ttft_s"] * 1e3 for r in rows]
            floor, med = statistics.median(r["floor_s"] for r in rows) * 1e3, statistics.median(ms)
            g = dict(regime=name, path=path, tokens=tokens, n=len(ms), ttft_ms=ms, median_ms=med, min_ms=min(ms),
                     max_ms=max(ms), floor_ms=floor, median_ratio=med / floor)
            base = first.setdefault(tokens, g)
            g["vs_first"] = base["path"]
            g["median_delta_ms"] = g["median_ms"] - base["median_ms"]
            g["min_delta_ms"] = g["min_ms"] - base["min_ms"]
            out.append(g)
    return out


def print_rounds(groups: list[dict]) -> None:
    """`rounds` as one line a group, where some path ran more than once."""
    if not any(g["n"] > 1 for g in groups):
        return
    print("rounds: regime path tokens | n | median (ratio) | min | max | median / min against the first path")
    for g in sorted(groups, key=lambda g: (g["regime"], g["tokens"])):
        vs = "" if g["path"] == g["vs_first"] else (f" | {g['median_delta_ms']:+.1f} / {g['min_delta_ms']:+.1f} ms "
                                                    f"against {g['vs_first']}")
        print(f"rounds: {g['regime']} {g['path']} {g['tokens']} | {g['n']} | {g['median_ms']:.1f} "
              f"({shown_ratio(g['median_ms'], g['floor_ms'])}) | {g['min_ms']:.1f} | {g['max_ms']:.1f}{vs}")


def shown_ratio(measured: float, floor: float) -> str:
    """A ratio for the brief lines, or "floor wrong" where the run beat its floor by more than MIN_RATIO allows (the
    ceiling probe read slower than the pipeline: the floor, not the run, is what is off)."""
    ratio, _ = ratio_or_note(measured, floor, "")
    return f"{ratio:.2f}" if ratio is not None else f"floor wrong: {measured / floor:.2f} < {MIN_RATIO}"


def brief(res) -> None:
    """--brief: one short line per prompt (a device call's console keeps only its tail), then the rounds."""
    c = res["ceilings"]
    after = c.get("disk_probe_after", {}).get("gbps")
    print(f"ceil h2d {c['h2d_gbps'] or 0:.1f} disk {c['disk_gbps']:.2f} (probes before {c['disk_probe']['gbps']:.2f}, "
          f"after {'-' if after is None else f'{after:.2f}'}) gemm {c['gemm_tflops']:.3f}")
    for name in [k for k in res if k == "ram" or k.startswith("disk")]:
        for path, rows in res[name].items():
            for r in rows:
                p = r.get("profile")
                prof = "" if p is None else (f" | prof {p['total_ms']:.0f}: mamba {p['mamba']:.1f} moe_d "
                                             f"{p['moe_dense']:.1f} exp {p['experts']:.1f} kern {p['experts_kernels']:.1f}"
                                             f" cp {p['experts_copies']:.1f} ahead {p['experts_copies_ahead']:.1f}")
                print(f"{name} {path} {r['tokens']}: {r['ttft_s'] * 1e3:.1f} ms floor {r['floor_s'] * 1e3:.1f} "
                      f"({shown_ratio(r['ttft_s'], r['floor_s'])}) tok {r['first_token']} launches {r['launches']}/"
                      f"{r.get('launches_indexed', '-')} rega {r.get('launches_rega', '-')} ahead {r['ahead_copied']}/"
                      f"{r['ahead_used']}/{r['ahead_wrong']} host ahead/moe/launch/stage/sync {r['ms_issuing_ahead']:.1f}/"
                      f"{r['ms_host_moe']:.1f}/{r['ms_host_launching']:.1f}/{r['ms_host_staging']:.1f}/"
                      f"{r['ms_router_sync']:.1f} start inputs/copy {r.get('ms_to_inputs', 0):.1f}/"
                      f"{r.get('ms_to_first_copy', 0):.1f} p/r "
                      f"{r['guess_precision']:.2f}/{r['guess_recall']:.2f} by tokens "
                      + " ".join(f"{k}:{'-' if v is None else f'{v:.2f}'}" for k, v in
                                 r.get('guess_precision_by_tokens', {}).items())
                      + f" peak/est {r['peak_bytes'] >> 20}/"
                      f"{r['estimated_bytes'] >> 20} pieces {r.get('piece_tokens')}/{r.get('mamba_piece_tokens')}" + prof)
                if r.get("io_trace"):
                    print(f"  {name} {r['tokens']}: {io_line(r['io_trace'])}")
    print_rounds(res["rounds"])
    for r in res.get("budget", []):
        floor = (f" floor {r['floor_s'] * 1e3:.1f} ({shown_ratio(r['ttft_s'], r['floor_s'])}, {r['floor_by']})"
                 if r.get("floor_s") else "")
        print(f"budget {r['tokens']}{' ' + r['env'] if r.get('env') else ''}: {r['ttft_s'] * 1e3:.1f} ms{floor} (runs "
              f"{'/'.join(f'{x * 1e3:.0f}' for x in r.get('ttft_runs_s', []))}) launches {r.get('launches')} "
              f"(fused {r.get('launches_fused', 0)} rega {r.get('launches_rega', 0)} "
              f"indexed {r.get('launches_indexed', '-')}) "
              f"spans {r['spans']} "
              f"slots {r['ahead_slot_bytes'] >> 20} "
              f"MiB ahead {r['ahead_copied']}/{r['ahead_used']}/{r['ahead_wrong']} peak/est {r['peak_bytes'] >> 20}/"
              f"{r['estimated_bytes'] >> 20} tok {r['first_token']} pieces {r['plan']['piece_tokens']}/"
              f"{r['plan']['mamba_piece_tokens']} lent {r.get('ahead_lent', 0)} (evicted {r.get('lent_evicted', 0)})")


def reprobe_disk(res, c, probe, cfg, block_bytes) -> None:
    """The disk's ceiling probed again after the disk rows, and every row's floor taken at the best of both probes:
    the hosts' virtual disks move by tens of percent within a call, and a probe that ran in a slow stretch made floors
    the rows beat (session 32 call 4: 1.41-1.50 GB/s before, the rows at 0.88-0.95 of their floors). The floor is the
    disk's best, not its mood at the start."""
    after = probe()
    c["disk_probe_after"] = after
    if after["gbps"] > c["disk_gbps"]:
        c["disk_gbps"] = after["gbps"]
        for name in [k for k in res if k == "ram" or k.startswith("disk")]:
            for rows in res[name].values():
                for r in rows:
                    with_floor(r, cfg, block_bytes, c)


def bus_bytes(r, block_bytes: int) -> int:
    """The expert bytes a prompt's row must move over the bus, once: its distinct experts less the VRAM tier's."""
    return (r["distinct_experts"] - r.get("tier_resident", 0)) * block_bytes


def disk_bytes(r, block_bytes: int) -> int:
    """The expert bytes a prompt's row must read from the disk, once: its routed experts missing from the RAM cache at
    its start, less those the VRAM tier held (read in place, or, with MOESTREAM_PREFILL_TIER=0, read again by choice:
    the same floor)."""
    return r.get("missing_not_in_tier", r["missing_at_start"]) * block_bytes


def with_floor(r, cfg, block_bytes, c) -> dict:
    """The floor: the largest of the distinct expert bytes over H2D (less those the VRAM tier holds, `--tier-mb`), the
    missing ones (less the tier's) over the disk, the FLOPs over the GEMM rate. H2D as the pipeline moves the bytes
    (the staging ring's copies from the slab, `h2d_staging_gbps`) where measured, else the 1 GiB pinned copy."""
    need = bus_bytes(r, block_bytes)
    miss = disk_bytes(r, block_bytes)
    h2d = c.get("h2d_staging_gbps") or c["h2d_gbps"]
    parts = dict(h2d=need / (h2d * 1e9) if h2d else 0.0, disk=miss / (c["disk_gbps"] * 1e9),
                 flops=prefill_flops(cfg, r["tokens"], r["expert_uses"]) / (c["gemm_tflops"] * 1e12))
    r["floor_parts_s"] = parts
    r["floor_s"] = max(parts.values())
    r["floor_by"] = max(parts, key=parts.get)
    r["ratio"] = r["ttft_s"] / r["floor_s"]
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--preset", default="super")
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--sizes", default="128,1000,4000,16000")
    ap.add_argument("--io-workers", type=int, default=8)
    ap.add_argument("--skip", default="", help="comma list of: kernel,sweep,ram,disk")
    ap.add_argument("--out", default="prefill.json")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (tiny preset, no kernel part)")
    ap.add_argument("--profile", action="store_true", help="each RAM-regime prompt once more, timed per stage")
    ap.add_argument("--disk-reads", default="as_slots_free",
                    help="comma list of the prefetcher's prefill read rules to run the disk regime under")
    ap.add_argument("--experts", type=int, help="tools.synth knob (a new --work only): routed experts per layer")
    ap.add_argument("--top-k", type=int, help="tools.synth knob (a new --work only): experts per token")
    ap.add_argument("--budget-mb", type=int, default=512,
                    help="the RAM regime's prompts of 1,000 tokens and more once more under this budget (the engine's "
                         "reserve through the server): spans, peak against the estimate; 0: not run")
    ap.add_argument("--budget-sizes", default="1000,4000,16000", help="comma list: the budget rows' prompt sizes")
    ap.add_argument("--budget-tier-mb", type=int, default=0,
                    help="a VRAM tier of this size beside the budget rows (as the server's --vram-gb leaves one), "
                         "empty: what a long prompt may borrow for its ahead slots (MOESTREAM_PREFILL_LEND); 0: none")
    ap.add_argument("--tier-mb", type=float, default=0,
                    help="every regime's engine with a VRAM tier of this size, filled (as decode leaves it warm) with "
                         "random experts; the floors count only the routed experts it does not hold (A/B the engine's "
                         "use of it with a path `staged|MOESTREAM_PREFILL_TIER=0`); 0: none")
    ap.add_argument("--budget-env", default="none",
                    help="comma list of KEY=VALUE (several joined by +) or none: the budget rows once per setting (an "
                         "A/B in one engine)")
    ap.add_argument("--budget-pieces", default="0",
                    help="comma list: the budget rows once per largest piece (MOESTREAM_PIECE_TOKENS; 0: the engine's "
                         "default, 4,096 since session 8; 512: the old plan)")
    ap.add_argument("--disk-paths", default="staged_no_ahead",
                    help="the disk regime's weight paths, each in a fresh engine (staged: the engine's default since "
                         "session 8, the copies ahead (at every size since session 15); staged_no_ahead: none)")
    ap.add_argument("--paths", default="staged_no_ahead,staged,zero_copy",
                    help="the RAM regime's weight paths (CUDA): staged, staged_no_ahead (the copies ahead off), "
                         "zero_copy; a path again as PATH#2; PATH@N: with pieces of at most N tokens "
                    "(MOESTREAM_PIECE_TOKENS; the default is 4,096 since session 8, 512 the old plan); PATH+ / PATH- "
                    "(or PATH@N+): session 7's glue / the old glue (the Mamba carry in one launch, adjacent staging "
                    "copies merged; on by default since session 8); PATH! (e.g. staged!): the copies ahead a block "
                    "at a time (MOESTREAM_AHEAD_RUNS=0; in runs by default since session 9); PATH~G: the copies ahead for prompts "
                    "of G tokens and more (0 by default since session 15; staged~2048: session 8-14's gate); PATH|KEY=VAL: an environment "
                         "switch for that path's prompts (e.g. staged|MOESTREAM_MAMBA_SSD=1)")
    ap.add_argument("--brief", action="store_true", help="one short line per prompt at the end, no tables")
    ap.add_argument("--io-trace", action="store_true",
                    help="the disk regime's IO workers trace their reads (cache_shm/io_trace.py); each disk row gets "
                         "the disk's busy share, reads in flight and rate while busy over its prompt (bench.io_trace)")
    a = ap.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench.prefill measures a GPU: no CUDA device here (--device cpu for a smoke run)")
    from gpu_worker.engine import StreamingEngine
    from expert_store.reader import ExpertStore
    from kernels.expert_block import ExpertGeometry
    from nemotron.config import NemotronHConfig
    device, skip = a.device, set(a.skip.split(","))
    cuda = device.startswith("cuda")
    if not cuda:
        skip.add("kernel")
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    model_dir, store_dir = work / "model", work / "store"
    res = dict(preset=a.preset, moe_layers=a.moe_layers, device=torch.cuda.get_device_name() if cuda else "cpu")
    if not (model_dir / "config.json").exists():
        knobs = [f for k, v in (("--experts", a.experts), ("--top-k", a.top_k)) if v for f in (k, str(v))]
        res["s_synth"] = sh([sys.executable, "-m", "tools.synth", "--preset", a.preset, "--quant", "nvfp4",
                             "--moe-layers", str(a.moe_layers), "--out", str(model_dir), *knobs])
    if not (store_dir / "manifest.json").exists():
        res["s_repack"] = sh([sys.executable, "-m", "tools.repack", "--model", str(model_dir), "--out",
                              str(store_dir), "--no-progress"])
    store = ExpertStore.open(store_dir)
    cfg = NemotronHConfig.from_dir(model_dir)
    g = store.geometry
    geom = g                    # the store's geometry is the kernels' ExpertGeometry
    n_blocks = len(store.moe_layers) * store.n_experts
    all_bytes = n_blocks * store.block_stride
    sizes = [int(s) for s in a.sizes.split(",")]
    c = res["ceilings"] = {}
    c["h2d_gbps"], c["d2d_gbps"] = copy_gbps(device)
    c["gemm_tflops"] = gemm_tflops(device)
    # the pipeline's own readers on cold block sets, best of three (bench/ceilings.py): one pass under-measured
    # the disk so that a prompt beat its floor (1.61 GB/s probe, 1.98 GB/s read: NOTES, session 3)
    # sets of 384 blocks (1.2 GB on Super), as many as a prompt's misses: sets of 96 under-measured the disk so that
    # the 1,000-16,000-token prompts beat their floors (0.88-0.93, H200 session 8)
    disk = pipeline_disk_gbps(store, io_workers=a.io_workers, blocks_per_set=min(384, n_blocks // 4), repeats=3)
    c["disk_gbps"], c["disk_probe"] = disk["gbps"], disk
    print(json.dumps(res), flush=True)
    out_path = Path(a.out)

    def save():          # after every part: a run stopped at its time limit still leaves what it measured
        out_path.write_text(json.dumps(res, indent=1, default=float))

    if "kernel" not in skip:
        res["kernel"] = kernel_bench(geom, device, c["gemm_tflops"], c["h2d_gbps"])
        save()
    vocab = cfg.vocab_size

    # prompts of varied real text through the checkpoint's tokenizer (the routing of random ids is not a prompt's),
    # a different window for every run
    from tokenizers import Tokenizer
    from bench.peers import texts
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    corpus = texts.load_text()

    def prompt(n, seed=1000):
        return text_ids(tokenizer, corpus, vocab, n, seed)

    def regime(name, cache_bytes, warm, paths=("staged",), profile=False, budget=False):
        """One regime's engine and rows; with --io-trace a disk regime's IO workers trace their reads (into a private
        directory for the engine's life) and each row gets bench.io_trace's account of its prompt's window."""
        if not (a.io_trace and name.startswith("disk")):
            return _regime(name, cache_bytes, warm, paths, profile, budget)
        from bench.io_trace import traced_reads
        with traced_reads() as d:
            return _regime(name, cache_bytes, warm, paths, profile, budget, trace_dir=d)

    def _regime(name, cache_bytes, warm, paths, profile, budget, trace_dir=None):
        out = {}
        with StreamingEngine(store_dir, cache_bytes=cache_bytes, io_workers=a.io_workers, device=device,
                             dtype=torch.bfloat16 if cuda else torch.float32) as eng:
            if warm:
                warm_all(eng, store)
                if cuda and "h2d_staging_gbps" not in c:   # every block cached: the staging ring's own copies
                    from bench.ceilings import staging_h2d_gbps
                    try:
                        c["h2d_staging"] = staging_h2d_gbps(eng.experts)
                    except Exception as err:      # the floors fall back to the 1 GiB copy, and say so
                        c["h2d_staging"] = dict(gbps=None, error=repr(err))
                        print(f"H2D through the staging ring not measured: {err!r}", flush=True)
                    c["h2d_staging_gbps"] = c["h2d_staging"]["gbps"]
                    if c["h2d_staging_gbps"]:
                        print(f"H2D through the staging ring from the slab: {c['h2d_staging_gbps']:.1f} GB/s (runs "
                              f"{[round(x, 1) for x in c['h2d_staging']['runs_gbps']]}); 1 GiB pinned copy "
                              f"{c['h2d_gbps']:.1f} GB/s", flush=True)
            from gpu_worker.prefill import prefill
            prefill(eng.model, prompt(64, seed=7), eng.model.new_state())      # compile the kernels, first touch
            if a.tier_mb:
                fill_tier(eng, int(a.tier_mb * 2**20), device, store)
            default_ahead = eng.experts.copy_ahead     # the engine's default (gpu_worker/streaming.py)
            default_gate = eng.experts.ahead_min_tokens
            for path in paths:
                # "staged#2": the same path again; "@512": pieces of up to 512 tokens (the old plan); "+" / "-":
                # the new / old glue (the Mamba carry in one launch, adjacent staging copies merged)
                base, piece, glue, runs = path_parts(path)
                new_glue(glue)
                if runs:                          # "!": the copies ahead a block at a time (the old way)
                    os.environ["MOESTREAM_AHEAD_RUNS"] = "0"
                else:
                    os.environ.pop("MOESTREAM_AHEAD_RUNS", None)
                if piece:
                    os.environ["MOESTREAM_PIECE_TOKENS"] = piece     # read by gpu_worker.prefill.span_plan per prompt
                else:
                    os.environ.pop("MOESTREAM_PIECE_TOKENS", None)
                with scoped_env(path_env(path)):
                    if cuda:
                        eng.experts.prefill_weights = "staged" if base == "staged_no_ahead" else base
                        eng.experts.copy_ahead = base != "staged_no_ahead"
                        gate = ahead_gate(path)
                        eng.experts.ahead_min_tokens = default_gate if gate is None else gate
                    rows = []
                    for n in sizes:
                        cold = None
                        if warm:     # the first prompt of a size compiles its kernel configurations: timed apart
                            cold = ttft(eng, prompt(n, seed=77), device)["ttft_s"]
                        r = with_floor(ttft(eng, prompt(n), device), cfg, store.block_bytes, c)
                        r["ttft_cold_s"] = cold
                        if trace_dir is not None:
                            r["io_trace"] = trace_summary(trace_dir, store.block_bytes, [r["window_ns"]])
                        if profile and path == paths[0]:
                            r["profile"] = profiled(eng, prompt(n), device)
                        rows.append(r)
                        print(name, path, json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                                                      for k, v in r.items() if k != "floor_parts_s"}), flush=True)
                    out[path] = rows
            os.environ.pop("MOESTREAM_PIECE_TOKENS", None)
            new_glue("")
            if budget and a.budget_mb:
                first = path_parts(paths[0])[0]
                os.environ.pop("MOESTREAM_AHEAD_RUNS", None)
                new_glue("")                                # the budget rows: the engine's default glue
                eng.experts.prefill_weights = (("staged" if first == "staged_no_ahead" else first) if cuda
                                               else eng.experts.prefill_weights)
                eng.experts.copy_ahead = default_ahead      # the budget rows run as the server would
                eng.experts.ahead_min_tokens = default_gate
                res["budget"] = []
                if a.budget_tier_mb:
                    used = torch.cuda.memory_allocated() if cuda else eng.model.dense_nbytes()
                    eng.experts.vram = eng._vram_tier(used + (a.budget_tier_mb << 20), 0, device, 2)
                for top in [int(t) for t in a.budget_pieces.split(",") if t]:
                    for env in a.budget_env.split(","):
                        arm = arm_env(env, f"--budget-env entry {env!r}")
                        named = env if arm else ""
                        if top:
                            arm["MOESTREAM_PIECE_TOKENS"] = str(top)
                        with scoped_env(arm):         # each key back to what it was after the arm
                            for n in [int(n) for n in a.budget_sizes.split(",") if n]:
                                r = with_floor(budgeted(eng, prompt(n), device, a.budget_mb << 20), cfg,
                                               store.block_bytes, c)
                                if a.profile and cuda:
                                    r["profile"] = profiled(eng, prompt(n), device, a.budget_mb << 20)
                                r["piece_top"], r["env"] = top, named
                                res["budget"].append(r)
                                print("budget", json.dumps(r, default=float), flush=True)
                                save()
        return out

    def compile_sizes():
        """Each size's kernel configurations compiled (Triton's JIT cache is the process's) in an engine of their own
        whose cache holds the store, before the disk rows: without the RAM rows first (`--skip ram`) the first disk
        engine timed its compiles (H200 session 18 call 1: 128 tokens 2.80 s and 4k 3.82 where the next engines took
        0.84-0.92 and 1.49-1.61)."""
        with StreamingEngine(store_dir, cache_bytes=int(all_bytes * 1.02) + (8 << 20), io_workers=a.io_workers,
                             device=device, dtype=torch.bfloat16 if cuda else torch.float32) as eng:
            warm_all(eng, store)
            for n in sizes:
                ttft(eng, prompt(n, seed=77), device)
        print(f"compiled the kernels of {len(sizes)} sizes before the disk rows", flush=True)

    if "ram" not in skip:
        res["ram"] = regime("ram", int(all_bytes * 1.02) + (8 << 20), True,
                            paths=tuple(a.paths.split(",")) if cuda else ("cpu",), profile=a.profile, budget=True)
        save()
    if "disk" not in skip:
        if "ram" in skip:     # no RAM rows compiled the sizes' kernels in this process: no disk row may time a compile
            compile_sizes()
        for rule in a.disk_reads.split(","):
            os.environ["MOESTREAM_PREFILL_READS"] = rule     # read by the prefetcher process the engine starts
            key = "disk" if rule == "as_slots_free" else f"disk_{rule}"
            # each weight path in an engine of its own: the cache starts empty in every one (a second path in the same
            # engine would find the first one's reads)
            for i, path in enumerate(a.disk_paths.split(",") if cuda else ["cpu"]):
                res[key if i == 0 else f"{key}_{path}"] = regime(key, all_bytes // 3, False, paths=(path,))
                save()
        os.environ.pop("MOESTREAM_PREFILL_READS", None)
        reprobe_disk(res, c, lambda: pipeline_disk_gbps(store, io_workers=a.io_workers,
                                                        blocks_per_set=min(384, n_blocks // 4), repeats=2),
                     cfg, store.block_bytes)
        save()
    if "sweep" not in skip and cuda:
        res["sweep"] = kernel_sweep(geom, device, c["gemm_tflops"])
        save()
    res["rounds"] = rounds(res)
    save()
    if a.brief:
        brief(res)
        return
    print(f"\nceilings: H2D {c['h2d_gbps']} GB/s, disk (pipeline) {c['disk_gbps']:.2f} GB/s, "
          f"GEMM {c['gemm_tflops']:.3f} TFLOP/s")
    for r in res.get("kernel", []):
        by_path = " ".join(f"{p} {r[f'vram_{p}_fraction_of_gemm']:.0%}" for p in KERNEL_PATHS
                           if f"vram_{p}_fraction_of_gemm" in r)
        print(f"kernel T/expert {r['tokens_per_expert']:>5}: vram ({r.get('path_vram', '?')}) {r['vram_tflops']:.1f} "
              f"TFLOP/s ({r['vram_fraction_of_gemm']:.0%} of GEMM; forced: {by_path}); zero-copy "
              f"({r.get('path_zero_copy', '?')}) {r['zero_copy_weight_gbps']:.1f} GB/s "
              f"({r['zero_copy_fraction_of_h2d']:.0%} of H2D); staged {r['staged_weight_gbps']:.1f} GB/s "
              f"({r['staged_fraction_of_h2d']:.0%}); faster: {r['faster_path']}; err {r['rel_err_vs_twin']:.1e}")
    for r in res.get("sweep", []):
        print(f"sweep T/expert {r['tokens_per_expert']:>5} v{r['variant']} X_LOAD {r['X_LOAD']} "
              f"{r['BLOCK_M']}x{r['BLOCK_N']}x{r['BLOCK_K']} w{r['num_warps']} s{r['num_stages']}: "
              + (f"{r['tflops']:.1f} TFLOP/s ({r['fraction_of_gemm']:.0%}), err {r['rel_err']:.1e}" if "tflops" in r
                 else r.get("error", "?")))
    print("regime | weights | tokens | TTFT s | floor s (by) | ratio | distinct | missing | blocks read (forced) | "
          "peak/est MiB | TTFT cold s")
    names = ["ram"] + [k for k in res if k == "disk" or k.startswith("disk_")]
    for name in names:
        for path, rows in res.get(name, {}).items():
            for r in rows:
                ratio, why = ratio_or_note(r["ttft_s"], r["floor_s"], f"{name} {r['tokens']} tokens")
                shown = f"{ratio:.2f}" if ratio is not None else f"floor wrong ({r['ratio']:.2f} < {MIN_RATIO})"
                print(f"{name} | {path} | {r['tokens']} | {r['ttft_s']:.3f} | {r['floor_s']:.3f} ({r['floor_by']}) | "
                      f"{shown} | {r['distinct_experts']} | {r['missing_at_start']} | {r['blocks_read']} "
                      f"({r['forced_reads']}) | "
                      f"{r['peak_bytes'] / 2**20:.0f}/{r['estimated_bytes'] / 2**20:.0f} | "
                      + (f"{r['ttft_cold_s']:.3f}" if r.get("ttft_cold_s") is not None else "-"))
    print("copies ahead | regime | weights | tokens | copied | used | wrong (MB wasted) | guess precision / recall")
    for name in names:
        for path, rows in res.get(name, {}).items():
            for r in rows:
                if "ahead_copied" in r:
                    print(f"ahead | {name} | {path} | {r['tokens']} | {r['ahead_copied']} | {r['ahead_used']} | "
                          f"{r['ahead_wrong']} ({r['bytes_wasted_ahead'] / 1e6:.0f}) | "
                          f"{r['guess_precision']:.3f} / {r['guess_recall']:.3f}")
    print_rounds(res["rounds"])
    for r in res.get("budget", []):
        print(f"budget {r['budget_bytes'] >> 20} MiB{' ' + r['env'] if r.get('env') else ''} | {r['tokens']} tokens | spans {r['spans']} | "
              f"TTFT {r['ttft_s']:.3f} s (floor {r.get('floor_s', 0):.3f}, {r.get('floor_by', '-')}) | launches "
              f"{r['launches']} (indexed {r.get('launches_indexed', '-')}) | "
              f"first token {r['first_token']} | peak/est MiB {r['peak_bytes'] / 2**20:.0f}/"
              f"{r['estimated_bytes'] / 2**20:.0f}"
              f" | peak within the estimate: {r['peak_within_estimate']} | ahead slots "
              f"{r['ahead_slot_bytes'] >> 20} MiB, copied {r['ahead_copied']}, used {r['ahead_used']}, "
              f"wrong {r['ahead_wrong']}")
    profiles = [(r["tokens"], r["ttft_s"], r["profile"]) for rows in res.get("ram", {}).values() for r in rows
                if "profile" in r]
    profiles += [(f"{r['tokens']} @{r['budget_bytes'] >> 20} MiB", r["ttft_s"], r["profile"])
                 for r in res.get("budget", []) if "profile" in r]
    if profiles:
        from gpu_worker.prefill_profile import EXPERT_SHARES, STAGES
        print("profile (RAM, ms) | tokens | TTFT plain / profiled | " + " | ".join(STAGES + EXPERT_SHARES))
        for n, plain, p in profiles:
            print(f"profile | {n} | {plain * 1e3:.1f} / {p['total_ms']:.1f} | "
                  + " | ".join(f"{p[k]:.1f}" for k in STAGES + EXPERT_SHARES))


if __name__ == "__main__":
    main()
