"""Write synthetic NemotronH checkpoints in the exact HuggingFace hub layout.

    python -m tools.synth --preset tiny|nano|super --quant nvfp4|mixed|bf16 --out DIR [--seed S]
        [--moe-layers N] [--sparsity 0.92] [--routing-skew 0.8] [--pattern P] [--experts E] [--top-k K]
        [--n-group G --topk-group T] [--hidden H] [--chunk-size C] [--max-shard-gb 4.5] [--workers W]
    python -m tools.synth --stats DIR [--prompts 8 --seq-len 48]

Everything is a pure function of (preset, knobs, seed): one generator per tensor, seeded from the tensor's
name, so files are identical run to run and tensors can be generated in parallel. Shards are streamed
tensor by tensor (never the whole model in RAM). The statistical design is in tools/synth_weights.py.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from tools.synth_weights import (ANCHOR_HIDDEN, ANCHOR_LATENT, Design, LinearSpec, gen, linear_meta,
                                 linear_tensors, routing_strength)

NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
SUPER_PATTERN = "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME"

PRESETS = {
    "tiny": dict(
        vocab_size=1024, hidden_size=128, hybrid_override_pattern="MEM*EM-EM*E",
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8,
        n_routed_experts=32, num_experts_per_tok=4, moe_intermediate_size=96,
        moe_shared_expert_intermediate_size=128, moe_latent_size=64, intermediate_size=192,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, max_position_embeddings=4096,
        moe_shared_expert_overlap=True),
    "nano": dict(
        vocab_size=131072, hidden_size=2688, hybrid_override_pattern=NANO_PATTERN,
        num_attention_heads=32, num_key_value_heads=2, head_dim=128,
        mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=128,
        n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
        moe_shared_expert_intermediate_size=3712, moe_latent_size=None, intermediate_size=1856,
        n_group=1, topk_group=1, routed_scaling_factor=2.5, max_position_embeddings=262144,
        moe_shared_expert_overlap=True),
    "super": dict(
        vocab_size=131072, hidden_size=4096, hybrid_override_pattern=SUPER_PATTERN,
        num_attention_heads=32, num_key_value_heads=2, head_dim=128,
        mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=128,
        n_routed_experts=512, num_experts_per_tok=22, moe_intermediate_size=2688,
        moe_shared_expert_intermediate_size=5376, moe_latent_size=1024, intermediate_size=2688,
        n_group=1, topk_group=1, routed_scaling_factor=5.0, max_position_embeddings=262144,
        moe_shared_expert_overlap=False),
}

# Storage dtypes of the small tensors, mixed across presets (the reader must accept any float dtype).
# Values: a dtype, or a pair (even layers, odd layers).
BF, F32 = torch.bfloat16, torch.float32
SMALL_DTYPES = {
    "tiny": dict(norm=(BF, F32), gate=F32, A_log=F32, D=(F32, BF), dt_bias=(BF, F32), conv1d=(F32, BF),
                 mamba_norm=BF, norm_f=F32),
    "nano": dict(norm=BF, gate=F32, A_log=F32, D=F32, dt_bias=F32, conv1d=BF, mamba_norm=BF, norm_f=BF),
    "super": dict(norm=BF, gate=BF, A_log=F32, D=BF, dt_bias=BF, conv1d=BF, mamba_norm=BF, norm_f=BF),
}
PRODUCERS = {"nvfp4": {"name": "modelopt", "version": "0.29.0"},
             "mixed": {"name": "modelopt", "version": "0.43.0.dev63+g449e700f9"}}
ST_DTYPE = {torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32", torch.bfloat16: "BF16",
            torch.float16: "F16"}


# ---------------------------------------------------------------- config

def shorten_pattern(pattern: str, moe_layers: int) -> str:
    """The pattern's first layers up to its Nth E; an attention layer is appended if none is left."""
    n = 0
    for i, c in enumerate(pattern):
        n += c == "E"
        if n == moe_layers:
            out = pattern[: i + 1]
            return out if "*" in out else out + "*"
    return pattern


def build_config(preset: str, quant: str, args) -> dict:
    p = dict(PRESETS[preset])
    if args.pattern:
        p["hybrid_override_pattern"] = args.pattern
    if args.moe_layers:
        p["hybrid_override_pattern"] = shorten_pattern(p["hybrid_override_pattern"], args.moe_layers)
    for knob, key in (("experts", "n_routed_experts"), ("top_k", "num_experts_per_tok"), ("hidden", "hidden_size"),
                      ("chunk_size", "chunk_size"), ("n_group", "n_group"), ("topk_group", "topk_group"),
                      ("latent", "moe_latent_size"), ("vocab", "vocab_size")):
        v = getattr(args, knob, None)
        if v is not None:
            p[key] = v if not (knob == "latent" and v == 0) else None
    pat = p["hybrid_override_pattern"]
    if set(pat) - set("ME*-"):
        raise SystemExit(f"pattern {pat!r}: only M, E, * and - are layer types")
    if p["n_routed_experts"] % p["n_group"] or p["topk_group"] > p["n_group"]:
        raise SystemExit("n_routed_experts must divide into n_group groups, topk_group <= n_group")
    for d in (p["hidden_size"], p["moe_intermediate_size"], p["moe_latent_size"] or 16):
        if d % 16:
            raise SystemExit(f"dimension {d} is not a multiple of 16 (NVFP4 blocks)")
    cfg = {
        "architectures": ["NemotronHForCausalLM"],
        "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_nemotron_h.NemotronHConfig",
                     "AutoModel": "modeling_nemotron_h.NemotronHForCausalLM",
                     "AutoModelForCausalLM": "modeling_nemotron_h.NemotronHForCausalLM"},
        "bos_token_id": 1, "chunk_size": p["chunk_size"], "conv_kernel": p["conv_kernel"], "eos_token_id": 2,
        "expand": 2, "head_dim": p["head_dim"], "hidden_dropout": 0.0, "hidden_size": p["hidden_size"],
        "hybrid_override_pattern": pat, "initializer_range": 0.02, "intermediate_size": p["intermediate_size"],
        "layer_norm_epsilon": 1e-05, "mamba_head_dim": p["mamba_head_dim"], "mamba_hidden_act": "silu",
        "mamba_num_heads": p["mamba_num_heads"], "mamba_proj_bias": False, "mamba_ssm_cache_dtype": "float32",
        "max_position_embeddings": p["max_position_embeddings"], "mlp_bias": False, "mlp_hidden_act": "relu2",
        "model_type": "nemotron_h", "moe_intermediate_size": p["moe_intermediate_size"],
        "moe_latent_size": p["moe_latent_size"],
        "moe_shared_expert_intermediate_size": p["moe_shared_expert_intermediate_size"],
        "moe_shared_expert_overlap": p["moe_shared_expert_overlap"],
        "n_group": p["n_group"], "n_groups": p["n_groups"], "n_routed_experts": p["n_routed_experts"],
        "n_shared_experts": 1, "norm_eps": 1e-05, "norm_topk_prob": True,
        "num_attention_heads": p["num_attention_heads"], "num_experts_per_tok": p["num_experts_per_tok"],
        "num_hidden_layers": len(pat), "num_key_value_heads": p["num_key_value_heads"], "num_logits_to_keep": 1,
        "num_nextn_predict_layers": 0, "pad_token_id": 0, "partial_rotary_factor": 1.0,
        "rescale_prenorm_residual": True, "residual_in_fp32": False, "rope_theta": 10000,
        "routed_scaling_factor": p["routed_scaling_factor"], "sliding_window": None,
        "ssm_state_size": p["ssm_state_size"], "tie_word_embeddings": False, "time_step_floor": 0.0001,
        "time_step_max": 0.1, "time_step_min": 0.001, "topk_group": p["topk_group"],
        "torch_dtype": "bfloat16", "transformers_version": "4.55.4", "use_bias": False, "use_cache": True,
        "use_conv_bias": True, "use_mamba_kernels": True, "vocab_size": p["vocab_size"],
    }
    return cfg


# ---------------------------------------------------------------- which format each Linear gets

def module_formats(cfg: dict, quant: str) -> dict:
    """module name -> 'nvfp4' | 'fp8' | 'bf16' for every Linear (experts included)."""
    pat = cfg["hybrid_override_pattern"]
    fmts: dict[str, str] = {}
    moe_ord = mamba_ord = 0
    attn_layers = [i for i, c in enumerate(pat) if c == "*"]
    for i, c in enumerate(pat):
        m = f"backbone.layers.{i}.mixer"
        before_attn = i + 1 < len(pat) and pat[i + 1] == "*"
        if c == "M":
            if quant == "nvfp4":
                f = "bf16" if before_attn else "nvfp4"
                fmts[f"{m}.in_proj"] = fmts[f"{m}.out_proj"] = f
            elif quant == "mixed":
                fmts[f"{m}.in_proj"] = "fp8" if mamba_ord % 2 == 0 else "bf16"
                fmts[f"{m}.out_proj"] = "fp8" if mamba_ord % 3 != 1 else "bf16"
            mamba_ord += 1
        elif c == "*":
            for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
                fmts[f"{m}.{p}"] = "bf16"
            if quant == "mixed" and i == attn_layers[-1]:
                fmts[f"{m}.o_proj"] = "fp8"
        elif c == "-":
            fmts[f"{m}.up_proj"] = {"nvfp4": "nvfp4", "mixed": "fp8"}.get(quant, "bf16")
            fmts[f"{m}.down_proj"] = {"nvfp4": "nvfp4"}.get(quant, "bf16")
        elif c == "E":
            ex = "bf16" if quant == "bf16" else "nvfp4"
            for e in range(cfg["n_routed_experts"]):
                fmts[f"{m}.experts.{e}.up_proj"] = fmts[f"{m}.experts.{e}.down_proj"] = ex
            if quant == "nvfp4":
                fmts[f"{m}.shared_experts.up_proj"] = fmts[f"{m}.shared_experts.down_proj"] = "nvfp4"
            elif quant == "mixed":
                fmts[f"{m}.shared_experts.up_proj"] = "fp8"
                fmts[f"{m}.shared_experts.down_proj"] = "nvfp4" if moe_ord == 0 else "fp8"
            if cfg["moe_latent_size"]:
                if quant == "nvfp4":
                    fmts[f"{m}.fc1_latent_proj"] = fmts[f"{m}.fc2_latent_proj"] = "nvfp4"
                elif quant == "mixed":
                    fmts[f"{m}.fc1_latent_proj"] = "fp8" if moe_ord < 3 else "bf16"
                    fmts[f"{m}.fc2_latent_proj"] = "fp8" if moe_ord == 1 else "bf16"
            moe_ord += 1
    return fmts


def quant_configs(cfg: dict, quant: str, fmts: dict):
    """-> (config.json quantization_config or None, hf_quant_config.json dict or None)."""
    if quant == "bf16":
        return None, None
    kv = {"dynamic": False, "num_bits": 8, "type": "float"}
    if quant == "nvfp4":
        pat = cfg["hybrid_override_pattern"]
        excl = ["lm_head"]
        for i, c in enumerate(pat):
            if c in "M*":
                excl += [f"backbone.layers.{i}.mixer.{p}" for p in
                         (("in_proj", "out_proj") if c == "M" else ("q_proj", "k_proj", "v_proj", "o_proj"))
                         if fmts.get(f"backbone.layers.{i}.mixer.{p}") == "bf16"]
        excl += [f"backbone.layers.{i}.mixer.conv1d" for i, c in enumerate(pat) if c == "M"]
        qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_scheme": kv,
              "ignore": excl, "producer": PRODUCERS["nvfp4"]}
        hq = {"producer": PRODUCERS["nvfp4"],
              "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16,
                               "exclude_modules": excl}}
        return qc, hq
    layers = {}
    for mod, f in fmts.items():
        if f == "nvfp4":
            layers[mod] = {"quant_algo": "NVFP4", "group_size": 16}
        elif f == "fp8":
            layers[mod] = {"quant_algo": "FP8"}
    qc = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "kv_cache_scheme": kv,
          "quantized_layers": layers, "producer": PRODUCERS["mixed"]}
    hq = {"producer": PRODUCERS["mixed"],
          "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8", "quantized_layers": layers}}
    return qc, hq


# ---------------------------------------------------------------- the tensor plan

@dataclass
class Job:
    meta: dict          # name -> (torch dtype, shape)
    produce: object     # () -> {name: tensor}

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * torch.empty((), dtype=d).element_size() for d, s in self.meta.values())


def _pick(dt, layer: int):
    return dt[layer % 2] if isinstance(dt, tuple) else dt


def _dense_job(name: str, dtype, shape, fn) -> Job:
    return Job({name: (dtype, list(shape))}, lambda: {name: fn().to(dtype).reshape(shape).contiguous()})


def _rows_randn(seed: int, name: str, rows: int, cols: int, std: float, zero_col: int | None,
                const_col: tuple | None, dtype, chunk_rows: int = 8192) -> torch.Tensor:
    """A big [rows, cols] Gaussian, generated in row chunks seeded by their offset (small fp32 temporaries,
    several threads: embeddings and lm_head of nano/super are the largest serial jobs)."""
    out = torch.empty(rows, cols, dtype=dtype)

    def fill(r0):
        g = gen(seed, f"{name}#{r0}")
        blk = torch.randn(min(chunk_rows, rows - r0), cols, generator=g) * std
        if zero_col is not None:
            blk[:, zero_col] = 0
        if const_col is not None:
            c, v = const_col
            blk[:, c] = v * (1 + 0.1 * (2 * torch.rand(blk.shape[0], generator=g) - 1))
        out[r0:r0 + blk.shape[0]] = blk.to(dtype)

    starts = range(0, rows, chunk_rows)
    if len(starts) == 1:
        fill(0)
    else:
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as ex:
            list(ex.map(fill, starts))
    return out


def plan(cfg: dict, quant: str, preset: str, seed: int, design: Design, reencode: bool) -> list[Job]:
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    pat = cfg["hybrid_override_pattern"]
    L = len(pat)
    dts = SMALL_DTYPES[preset]
    fmts = module_formats(cfg, quant)
    jobs: list[Job] = []
    z = (ANCHOR_HIDDEN,)

    def lin(name, spec, layer):
        f = fmts.get(name, "bf16")
        vec = layer % 2 == 1  # scalars 0-dim on even layers, [1] on odd ones
        jobs.append(Job(linear_meta(name, spec, f, vec),
                        lambda: linear_tensors(name, spec, f, seed, vec, reencode)))

    def small(name, dtype, shape, fn):
        jobs.append(_dense_job(name, dtype, shape, fn))

    jobs.append(_dense_job("backbone.embeddings.weight", BF, (V, H),
                           lambda: _rows_randn(seed, "emb", V, H, 1.0, None, (ANCHOR_HIDDEN, math.sqrt(H)), BF)))
    nh, hd, ng, N, K = (cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["n_groups"], cfg["ssm_state_size"],
                        cfg["conv_kernel"])
    I_m = nh * hd
    conv_dim = I_m + 2 * ng * N
    beta = design.beta
    for i, c in enumerate(pat):
        m = f"backbone.layers.{i}.mixer"
        hr = design.h_rest_norm(i)
        w0 = design.anchor_norm_weight(i) if c in "E-" else 1.0

        def norm_fn(i=i, w0=w0, n=H):
            g = gen(seed, f"norm{i}")
            w = 1 + 0.05 * torch.randn(n, generator=g)
            w[ANCHOR_HIDDEN] = w0
            return w
        small(f"backbone.layers.{i}.norm.weight", _pick(dts["norm"], i), (H,), norm_fn)
        if c == "M":
            lin(f"{m}.in_proj", LinearSpec(I_m + conv_dim + nh, H, 1 / hr, zero_cols=z,
                                           small_rows=(I_m + conv_dim, I_m + conv_dim + nh)), i)
            small(f"{m}.conv1d.weight", _pick(dts["conv1d"], i), (conv_dim, 1, K),
                  lambda i=i: 0.5 * torch.randn(conv_dim, 1, K, generator=gen(seed, f"conv{i}")))
            small(f"{m}.conv1d.bias", _pick(dts["conv1d"], i), (conv_dim,),
                  lambda i=i: 0.1 * torch.randn(conv_dim, generator=gen(seed, f"convb{i}")))

            def dt_bias(i=i):  # softplus(dt_bias) log-uniform in [0.01, 0.1]
                u = torch.rand(nh, generator=gen(seed, f"dt{i}"))
                dt = torch.exp(math.log(0.01) + u * (math.log(0.1) - math.log(0.01)))
                return dt + torch.log(-torch.expm1(-dt))
            small(f"{m}.dt_bias", _pick(dts["dt_bias"], i), (nh,), dt_bias)
            small(f"{m}.A_log", _pick(dts["A_log"], i), (nh,),
                  lambda i=i: torch.log(1 + 15 * torch.rand(nh, generator=gen(seed, f"A{i}"))))
            small(f"{m}.D", _pick(dts["D"], i), (nh,),
                  lambda i=i: 1 + 0.1 * torch.randn(nh, generator=gen(seed, f"D{i}")))
            small(f"{m}.norm.weight", _pick(dts["mamba_norm"], i), (I_m,),
                  lambda i=i: 1 + 0.05 * torch.randn(I_m, generator=gen(seed, f"mnorm{i}")))
            lin(f"{m}.out_proj", LinearSpec(H, I_m, beta / math.sqrt(I_m), zero_rows=z), i)
        elif c == "*":
            nq, nkv, ahd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
            lin(f"{m}.q_proj", LinearSpec(nq * ahd, H, math.sqrt(2) / hr, zero_cols=z), i)
            lin(f"{m}.k_proj", LinearSpec(nkv * ahd, H, math.sqrt(2) / hr, zero_cols=z), i)
            lin(f"{m}.v_proj", LinearSpec(nkv * ahd, H, 1 / hr, zero_cols=z), i)
            lin(f"{m}.o_proj", LinearSpec(H, nq * ahd, beta / (0.6 * math.sqrt(nq * ahd)), zero_rows=z), i)
            if quant != "bf16":
                small(f"{m}.k_proj.k_scale", F32, [] if i % 2 == 0 else [1], lambda: torch.tensor(1.0))
                small(f"{m}.v_proj.v_scale", F32, [] if i % 2 == 0 else [1], lambda: torch.tensor(1.0))
        elif c == "-":
            n_i = cfg["intermediate_size"]
            lin(f"{m}.up_proj", LinearSpec(n_i, H, 1 / hr, anchor_col=ANCHOR_HIDDEN), i)
            lin(f"{m}.down_proj", LinearSpec(H, n_i, design.relu2_down_std(n_i, beta), zero_rows=z), i)
        elif c == "E":
            E, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
            lat = cfg["moe_latent_size"]
            rsf = cfg["routed_scaling_factor"]
            small(f"{m}.gate.weight", _pick(dts["gate"], i), (E, H),
                  lambda i=i, hr=hr: _rows_randn(seed, f"gate{i}", E, H, 1 / hr, ANCHOR_HIDDEN, None, F32))
            g_bias = gen(seed, f"bias{i}")
            rank = torch.randperm(E, generator=g_bias)
            bias_noise = 0.01 * torch.randn(E, generator=g_bias)
            x_skew = routing_strength(E, k, design.lru_target, 1.0, cfg["n_group"], cfg["topk_group"], rank)

            def bias_fn(rank=rank, x_skew=x_skew, bias_noise=bias_noise):
                return -x_skew * torch.log1p(rank.float()) + bias_noise
            small(f"{m}.gate.e_score_correction_bias", F32, (E,), bias_fn)
            b_r = beta * math.sqrt(design.moe_energy * design.routed_share)
            b_s = beta * math.sqrt(design.moe_energy * (1 - design.routed_share))
            if lat:
                s1 = 1 / math.sqrt(H)
                lin(f"{m}.fc1_latent_proj", LinearSpec(lat, H, s1, zero_cols=z,
                                                       boost=(ANCHOR_LATENT, ANCHOR_HIDDEN, s1 * math.sqrt(lat))), i)
                up = LinearSpec(cfg["moe_intermediate_size"], lat, 1 / (s1 * math.sqrt(lat) * hr),
                                anchor_col=ANCHOR_LATENT, coherence=design.neuron_coherence)
                down = LinearSpec(lat, cfg["moe_intermediate_size"],
                                  design.relu2_down_std(cfg["moe_intermediate_size"], b_r, k, rsf))
            else:
                up = LinearSpec(cfg["moe_intermediate_size"], H, 1 / hr, anchor_col=ANCHOR_HIDDEN,
                                coherence=design.neuron_coherence)
                down = LinearSpec(H, cfg["moe_intermediate_size"],
                                  design.relu2_down_std(cfg["moe_intermediate_size"], b_r, k, rsf), zero_rows=z)
            for e in range(E):
                lin(f"{m}.experts.{e}.up_proj", up, i)
                lin(f"{m}.experts.{e}.down_proj", down, i)
            if lat:
                lin(f"{m}.fc2_latent_proj", LinearSpec(H, lat, 1 / math.sqrt(lat), zero_rows=z), i)
            sI = cfg["moe_shared_expert_intermediate_size"]
            lin(f"{m}.shared_experts.up_proj", LinearSpec(sI, H, 1 / hr, anchor_col=ANCHOR_HIDDEN), i)
            lin(f"{m}.shared_experts.down_proj", LinearSpec(H, sI, design.relu2_down_std(sI, b_s), zero_rows=z), i)
    small("backbone.norm_f.weight", dts["norm_f"], (H,),
          lambda: 1 + 0.05 * torch.randn(H, generator=gen(seed, "norm_f")))
    lm_std = design.logit_std() / design.h_rest_norm(L)
    jobs.append(_dense_job("lm_head.weight", BF, (V, H),
                           lambda: _rows_randn(seed, "lm_head", V, H, lm_std, ANCHOR_HIDDEN, None, BF)))
    return jobs


# ---------------------------------------------------------------- streaming safetensors writer

def split_shards(jobs: list[Job], max_shard_bytes: int, min_shards: int = 2) -> list[list[Job]]:
    """Cut the job list (in order) into >= min_shards shards of about equal size, each <= max where possible."""
    total = sum(j.nbytes for j in jobs)
    n = min(len(jobs), max(min_shards, math.ceil(total / max_shard_bytes)))
    target = total / n
    shards, acc = [[]], 0
    for idx, j in enumerate(jobs):
        still_to_open = n - len(shards)
        if shards[-1] and still_to_open > 0 and (acc + j.nbytes > max_shard_bytes or acc >= target
                                                  or len(jobs) - idx <= still_to_open):
            shards.append([])
            acc = 0
        shards[-1].append(j)
        acc += j.nbytes
    return shards


def _header(jobs: list[Job]) -> bytes:
    hdr, off = {}, 0
    for j in jobs:
        for name, (dt, shape) in j.meta.items():
            nb = math.prod(shape) * torch.empty((), dtype=dt).element_size()
            hdr[name] = {"dtype": ST_DTYPE[dt], "shape": list(shape), "data_offsets": [off, off + nb]}
            off += nb
    hdr["__metadata__"] = {"format": "pt"}
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def write_shards(out: Path, shards: list[list[Job]], workers: int, progress: bool = True) -> dict:
    weight_map, total = {}, 0
    n = len(shards)
    all_jobs = [(s, j) for s, jobs in enumerate(shards) for j in jobs]
    total_bytes = sum(j.nbytes for _, j in all_jobs)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="writing", file=sys.stderr)
    files = [open(out / f"model-{s + 1:05d}-of-{n:05d}.safetensors", "wb") for s in range(n)]
    try:
        for s, jobs in enumerate(shards):
            files[s].write(_header(jobs))
        with ThreadPoolExecutor(max_workers=workers) as ex:
            pending: deque = deque()
            it = iter(all_jobs)
            for s, j in it:
                pending.append((s, j, ex.submit(j.produce)))
                if len(pending) >= 4 * workers:
                    break
            while pending:
                s, j, fut = pending.popleft()
                tensors = fut.result()
                nxt = next(it, None)
                if nxt is not None:
                    pending.append((nxt[0], nxt[1], ex.submit(nxt[1].produce)))
                fname = f"model-{s + 1:05d}-of-{n:05d}.safetensors"
                for name, (dt, shape) in j.meta.items():
                    t = tensors[name]
                    if t.dtype != dt or list(t.shape) != list(shape):
                        raise AssertionError(f"{name}: produced {t.dtype}{list(t.shape)}, planned {dt}{shape}")
                    buf = t.contiguous().reshape(-1).view(torch.uint8).numpy()
                    files[s].write(memoryview(buf))
                    weight_map[name] = fname
                    total += buf.nbytes
                if bar:
                    bar.update(j.nbytes)
    finally:
        for f in files:
            f.close()
        if bar:
            bar.close()
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


# ---------------------------------------------------------------- top level

def synthesize(out, preset: str = "tiny", quant: str = "nvfp4", seed: int = 0, moe_layers: int | None = None,
               sparsity: float = 0.92, routing_skew: float = 0.8, max_shard_gb: float = 4.5,
               workers: int | None = None, progress: bool = False, reencode: bool | None = None,
               design_overrides: dict | None = None, **knobs) -> dict:
    """Write a checkpoint to `out`; returns its config dict. knobs: pattern, experts, top_k, hidden, chunk_size,
    n_group, topk_group, latent, vocab."""
    from tools.synth_tokenizer import write_tokenizer
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}")
    if quant not in ("nvfp4", "mixed", "bf16"):
        raise ValueError(f"unknown quant mode {quant!r}")
    ns = argparse.Namespace(moe_layers=moe_layers, **{k: knobs.get(k) for k in
                            ("pattern", "experts", "top_k", "hidden", "chunk_size", "n_group", "topk_group",
                             "latent", "vocab")})
    unknown = set(knobs) - set(vars(ns))
    if unknown:
        raise TypeError(f"unknown knobs {sorted(unknown)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = build_config(preset, quant, ns)
    design = Design(cfg, sparsity=sparsity, lru_target=routing_skew, **(design_overrides or {}))
    fmts = module_formats(cfg, quant)
    qc, hq = quant_configs(cfg, quant, fmts)
    if qc is not None:
        cfg["quantization_config"] = qc
    reencode = (preset == "tiny") if reencode is None else reencode
    jobs = plan(cfg, quant, preset, seed, design, reencode)
    shards = split_shards(jobs, int(max_shard_gb * 1e9))
    t0 = time.time()
    index = write_shards(out, shards, workers or min(16, os.cpu_count() or 1), progress)
    dt = time.time() - t0
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if hq is not None:
        (out / "hf_quant_config.json").write_text(json.dumps(hq, indent=4) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": [2, 11], "pad_token_id": 0,
         "transformers_version": "4.55.4"}, indent=2) + "\n")
    write_tokenizer(out, cfg["vocab_size"])
    gb = index["metadata"]["total_size"] / 1e9
    if progress:
        print(f"wrote {gb:.3f} GB in {len(shards)} shards to {out} in {dt:.1f} s ({gb / max(dt, 1e-9):.2f} GB/s)",
              file=sys.stderr)
    return cfg


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tools.synth", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--quant", choices=("nvfp4", "mixed", "bf16"), default="nvfp4")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--moe-layers", type=int, help="keep the pattern's first layers up to the Nth MoE layer")
    ap.add_argument("--sparsity", type=float, default=0.92, help="target fraction of zero ReLU^2 expert neurons")
    ap.add_argument("--routing-skew", type=float, default=0.8,
                    help="target LRU hit rate of a cache of 25%% of a layer's experts (0 = uniform routing)")
    ap.add_argument("--neuron-coherence", type=float, default=0.0,
                    help="share of each routed expert's up codes copied within 16-neuron groups, so that neurons "
                         "fire together as in a trained model (0 = independent zeros; docs/instrument.md)")
    ap.add_argument("--pattern")
    ap.add_argument("--experts", type=int)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--n-group", type=int)
    ap.add_argument("--topk-group", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--latent", type=int, help="moe_latent_size (0 = none)")
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--chunk-size", type=int)
    ap.add_argument("--max-shard-gb", type=float, default=4.5)
    ap.add_argument("--workers", type=int)
    ap.add_argument("--reencode", action=argparse.BooleanOptionalAction, default=None,
                    help="encode NVFP4 from the float weights with ModelOpt's algorithm (default: tiny only)")
    ap.add_argument("--stats", type=Path, metavar="DIR", help="measure sparsity/routing/logit statistics of DIR")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=48)
    a = ap.parse_args(argv)
    if a.stats:
        from tools.synth_stats import format_stats, measure_stats
        print(format_stats(measure_stats(a.stats, n_prompts=a.prompts, seq_len=a.seq_len)))
        return
    if a.out is None:
        ap.error("--out is required")
    if not 0.0 <= a.neuron_coherence < 1.0:
        ap.error("--neuron-coherence must be in [0, 1)")
    synthesize(a.out, a.preset, a.quant, a.seed, a.moe_layers, a.sparsity, a.routing_skew, a.max_shard_gb,
               a.workers, True, a.reencode,
               design_overrides={"neuron_coherence": a.neuron_coherence} if a.neuron_coherence else None,
               pattern=a.pattern, experts=a.experts, top_k=a.top_k, hidden=a.hidden,
               chunk_size=a.chunk_size, n_group=a.n_group, topk_group=a.topk_group, latent=a.latent, vocab=a.vocab)


if __name__ == "__main__":
    main()
