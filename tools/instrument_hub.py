"""The instrument in the HuggingFace hub layout: write it (BF16, or NVFP4 through the project's ModelOpt-exact
encoder with activation scales from a calibration pass) and read any hub checkpoint back into the trainer's
model (dequantized), so that trainer and engine can be compared on the same weights.

The NVFP4 layout is the one tools/synth writes for `--quant nvfp4` (same module formats, same
hf_quant_config.json / quantization_config): routed and shared experts, latent projections and the Mamba
projections in NVFP4 except those of the Mamba layer before each attention layer; attention, embeddings,
lm_head, norms, router and SSM parameters unquantized.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kernels.nvfp4 import E2M1_MAX, E4M3_MAX, encode_nvfp4
from tools.instrument_model import InstrumentConfig, InstrumentLM, Mamba2, MoE

BF, F32 = torch.bfloat16, torch.float32
# storage dtypes of the tensors that are not Linears (the engine accepts any float dtype)
SMALL_DTYPE = {"norm": BF, "A_log": F32, "D": F32, "dt_bias": F32, "conv1d": BF, "mamba_norm": BF, "gate": F32,
               "bias": F32, "norm_f": BF}


def hub_config(cfg: InstrumentConfig, quant: str) -> dict:
    """config.json as NVIDIA's hub checkpoints write it (tools.synth's key set, this model's sizes)."""
    from tools.synth import build_config, module_formats, quant_configs
    ns = argparse.Namespace(pattern=cfg.pattern, moe_layers=None, experts=cfg.n_routed_experts,
                            top_k=cfg.num_experts_per_tok, hidden=cfg.hidden_size, chunk_size=cfg.chunk_size,
                            n_group=cfg.n_group, topk_group=cfg.topk_group, latent=cfg.moe_latent_size or 0,
                            vocab=cfg.vocab_size)
    out = build_config("tiny", quant, ns)
    out.update({
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "mamba_num_heads": cfg.mamba_num_heads, "mamba_head_dim": cfg.mamba_head_dim,
        "ssm_state_size": cfg.ssm_state_size, "n_groups": cfg.n_groups, "conv_kernel": cfg.conv_kernel,
        "moe_intermediate_size": cfg.moe_intermediate_size, "intermediate_size": cfg.intermediate_size,
        "moe_shared_expert_intermediate_size": cfg.moe_shared_expert_intermediate_size,
        "moe_shared_expert_overlap": False, "routed_scaling_factor": cfg.routed_scaling_factor,
        "norm_topk_prob": cfg.norm_topk_prob, "layer_norm_epsilon": cfg.layer_norm_epsilon,
        "norm_eps": cfg.layer_norm_epsilon, "max_position_embeddings": 262144,
        "time_step_min": cfg.time_step_min, "time_step_max": cfg.time_step_max,
        "time_step_floor": cfg.time_step_floor, "initializer_range": cfg.initializer_range,
    })
    if quant != "bf16":
        qc, _ = quant_configs(out, quant, module_formats(out, quant))
        out["quantization_config"] = qc
    return out


def pattern_of(d: dict) -> str:
    """The layer pattern from a hub config (`hybrid_override_pattern`) or a transformers-saved one (a list)."""
    if "hybrid_override_pattern" in d:
        return d["hybrid_override_pattern"]
    names = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "moe": "E", "mlp": "-"}
    return "".join(names[t] for t in d["layers_block_type"])


def config_from_hub(d: dict) -> InstrumentConfig:
    return InstrumentConfig(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], pattern=pattern_of(d),
        num_attention_heads=d["num_attention_heads"], num_key_value_heads=d["num_key_value_heads"],
        head_dim=d["head_dim"], mamba_num_heads=d["mamba_num_heads"], mamba_head_dim=d["mamba_head_dim"],
        ssm_state_size=d["ssm_state_size"], n_groups=d["n_groups"], conv_kernel=d["conv_kernel"],
        chunk_size=d.get("chunk_size", 128), n_routed_experts=d["n_routed_experts"],
        num_experts_per_tok=d["num_experts_per_tok"], moe_intermediate_size=d["moe_intermediate_size"],
        moe_latent_size=d.get("moe_latent_size"),
        moe_shared_expert_intermediate_size=d["moe_shared_expert_intermediate_size"],
        intermediate_size=d.get("intermediate_size", 0), n_group=d.get("n_group", 1),
        topk_group=d.get("topk_group", 1), routed_scaling_factor=d.get("routed_scaling_factor", 1.0),
        norm_topk_prob=d.get("norm_topk_prob", True), layer_norm_epsilon=d.get("layer_norm_epsilon", 1e-5))


# ---------------------------------------------------------------- names

def linear_modules(model: InstrumentLM) -> dict[str, torch.Tensor]:
    """hub module name -> weight [out, in] (a view of the parameter), every Linear incl. each routed expert."""
    out = {}
    for i, layer in enumerate(model.layers):
        m, p = layer.mixer, f"backbone.layers.{i}.mixer"
        if layer.kind == "M":
            out[f"{p}.in_proj"], out[f"{p}.out_proj"] = m.in_proj.weight, m.out_proj.weight
        elif layer.kind == "*":
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                out[f"{p}.{n}"] = getattr(m, n).weight
        elif layer.kind == "-":
            out[f"{p}.up_proj"], out[f"{p}.down_proj"] = m.up_proj.weight, m.down_proj.weight
        else:
            if m.fc1 is not None:
                out[f"{p}.fc1_latent_proj"], out[f"{p}.fc2_latent_proj"] = m.fc1.weight, m.fc2.weight
            for e in range(m.E):
                out[f"{p}.experts.{e}.up_proj"], out[f"{p}.experts.{e}.down_proj"] = m.up[e], m.down[e]
            out[f"{p}.shared_experts.up_proj"] = m.shared_up.weight
            out[f"{p}.shared_experts.down_proj"] = m.shared_down.weight
    out["lm_head"] = model.lm_head.weight
    return out


def other_tensors(model: InstrumentLM) -> dict[str, tuple[torch.Tensor, torch.dtype]]:
    """hub tensor name -> (tensor, storage dtype) for everything that is not a Linear."""
    out = {"backbone.embeddings.weight": (model.embeddings.weight, BF),
           "backbone.norm_f.weight": (model.norm_f.weight, SMALL_DTYPE["norm_f"])}
    for i, layer in enumerate(model.layers):
        m, p = layer.mixer, f"backbone.layers.{i}.mixer"
        out[f"backbone.layers.{i}.norm.weight"] = (layer.norm.weight, SMALL_DTYPE["norm"])
        if isinstance(m, Mamba2):
            out[f"{p}.conv1d.weight"] = (m.conv1d.weight, SMALL_DTYPE["conv1d"])
            out[f"{p}.conv1d.bias"] = (m.conv1d.bias, SMALL_DTYPE["conv1d"])
            out[f"{p}.dt_bias"] = (m.dt_bias, SMALL_DTYPE["dt_bias"])
            out[f"{p}.A_log"] = (m.A_log, SMALL_DTYPE["A_log"])
            out[f"{p}.D"] = (m.D, SMALL_DTYPE["D"])
            out[f"{p}.norm.weight"] = (m.norm, SMALL_DTYPE["mamba_norm"])
        elif isinstance(m, MoE):
            out[f"{p}.gate.weight"] = (m.gate, SMALL_DTYPE["gate"])
            out[f"{p}.gate.e_score_correction_bias"] = (m.e_score_correction_bias, SMALL_DTYPE["bias"])
    return out


# ---------------------------------------------------------------- calibration (ModelOpt's input_scale)

@torch.no_grad()
def calibrate(model: InstrumentLM, batches) -> dict[str, float]:
    """Activation amax of every Linear's input over `batches` (ids [b, T]); experts through the loop path."""
    amax: dict[str, float] = {}
    names = {id(w): n for n, w in linear_modules(model).items()}
    hooks = []

    def note(name, x):
        v = float(x.detach().abs().amax()) if x.numel() else 0.0
        amax[name] = max(amax.get(name, 0.0), v)

    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear) and id(mod.weight) in names:
            n = names[id(mod.weight)]
            hooks.append(mod.register_forward_pre_hook(lambda m, a, n=n: note(n, a[0])))
    paths = [m.expert_path for m in model.moes()]
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mixer, MoE):
            p = f"backbone.layers.{i}.mixer.experts"
            layer.mixer.expert_path = "loop"
            layer.mixer.observe = lambda key, x, p=p: note(f"{p}.{key[1]}.{key[0]}_proj", x)
    was_training = model.training
    model.eval()
    try:
        for ids in batches:
            model(ids)
    finally:
        for h in hooks:
            h.remove()
        for m, path in zip(model.moes(), paths):
            m.observe, m.expert_path = None, path
        model.train(was_training)
    return amax


# ---------------------------------------------------------------- writing

def _shards(tensors: dict[str, torch.Tensor], n_min: int = 2, max_bytes: int = 2 * 10**9) -> list[dict]:
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    n = max(n_min, math.ceil(total / max_bytes))
    target, out, acc = total / n, [{}], 0
    for name, t in tensors.items():
        if out[-1] and acc >= target and len(out) < n:
            out.append({})
            acc = 0
        out[-1][name] = t
        acc += t.numel() * t.element_size()
    return out


def write_checkpoint(model: InstrumentLM, out_dir, quant: str, tokenizer_dir, amax: dict | None = None) -> Path:
    """Hub-layout checkpoint of `model` in 'bf16' or 'nvfp4' (ModelOpt's NVFP4 encoding, kernels/nvfp4.py)."""
    from tools.synth import module_formats, quant_configs
    if quant not in ("bf16", "nvfp4"):
        raise ValueError(f"quant must be bf16 or nvfp4, got {quant!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = hub_config(model.cfg, quant)
    fmts = module_formats(cfg, quant)
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, (t, dt) in other_tensors(model).items():
            tensors[name] = t.detach().to(dt).cpu().contiguous()
        for mod, w in linear_modules(model).items():
            if fmts.get(mod, "bf16") == "nvfp4":
                packed, scale, g = encode_nvfp4(w.detach().float())
                a = (amax or {}).get(mod) or 1.0
                tensors[f"{mod}.weight"] = packed.cpu().contiguous()
                tensors[f"{mod}.weight_scale"] = scale.cpu().contiguous()
                tensors[f"{mod}.weight_scale_2"] = g.reshape(()).float().cpu()
                tensors[f"{mod}.input_scale"] = torch.tensor(a / (E2M1_MAX * E4M3_MAX), dtype=F32)
            else:
                tensors[f"{mod}.weight"] = w.detach().to(BF).cpu().contiguous()
        if quant != "bf16":     # FP8 KV-cache scales, as ModelOpt writes them (read by nobody with bf16 KV)
            for i, c in enumerate(model.cfg.pattern):
                if c == "*":
                    for kv in ("k", "v"):
                        tensors[f"backbone.layers.{i}.mixer.{kv}_proj.{kv}_scale"] = torch.tensor(1.0, dtype=F32)
    tensors = dict(sorted(tensors.items(), key=lambda kv: _order_key(kv[0])))
    shards = _shards(tensors)
    weight_map, total = {}, 0
    for s, part in enumerate(shards):
        fname = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, str(out / fname), metadata={"format": "pt"})
        for name, t in part.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if quant != "bf16":
        _, hq = quant_configs(cfg, quant, fmts)
        (out / "hf_quant_config.json").write_text(json.dumps(hq, indent=4) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": [2, 11], "pad_token_id": 0,
         "transformers_version": cfg["transformers_version"]}, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(Path(tokenizer_dir) / f, out / f)
    return out


def _order_key(name: str):
    """Layer order, as the hub shards are laid out (embeddings first, lm_head last)."""
    if name.startswith("backbone.layers."):
        rest = name[len("backbone.layers."):]
        i, tail = rest.split(".", 1)
        return (1, int(i), tail)
    return (0 if "embeddings" in name else 2, 0, name)


# ---------------------------------------------------------------- reading

def load_checkpoint(model_dir, device="cpu") -> InstrumentLM:
    """Any hub-layout NemotronH checkpoint (BF16, FP8, NVFP4) into the trainer's model, dequantized to fp32."""
    import tempfile

    from tools.hf_reference import dequantize_checkpoint
    cfg = config_from_hub(json.loads((Path(model_dir) / "config.json").read_text()))
    model = InstrumentLM(cfg)
    with tempfile.TemporaryDirectory(prefix="moestream-instrument-") as tmp:
        dense = load_file(str(dequantize_checkpoint(model_dir, tmp) / "model.safetensors"))
    with torch.no_grad():
        for name, (t, _) in other_tensors(model).items():
            t.copy_(dense.pop(name).reshape(t.shape))
        for mod, w in linear_modules(model).items():
            w.copy_(dense.pop(f"{mod}.weight"))
    left = sorted(dense)
    if left:
        raise ValueError(f"{model_dir}: tensors the model has no place for: {left[:5]}")
    return model.to(device).eval()


# ---------------------------------------------------------------- the command: quantize a BF16 checkpoint

def main(argv=None) -> int:
    """python -m tools.instrument_hub --model BF16_DIR --out DIR [--quant nvfp4] [--calib-text F]

    The exact path of the co-activation order for NVFP4: order the BF16 checkpoint (`python -m tools.coactivation`,
    exact on BF16), then quantize the ordered checkpoint here — the same encoder and layout as the trainer's own
    NVFP4 output, so the ordered model is quantized exactly as the unordered one would have been."""
    import sys
    ap = argparse.ArgumentParser(prog="python -m tools.instrument_hub", description=main.__doc__.split("\n\n")[1])
    ap.add_argument("--model", required=True, type=Path, help="BF16 (or FP32) hub checkpoint of a NemotronH")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quant", choices=["bf16", "nvfp4"], default="nvfp4")
    ap.add_argument("--calib-text", type=Path, help="text for the activation scales (input_scale); default 1.0")
    ap.add_argument("--calib-tokens", type=int, default=2048)
    a = ap.parse_args(argv)
    try:
        cfg = json.loads((a.model / "config.json").read_text())
        if cfg.get("quantization_config") or (a.model / "hf_quant_config.json").exists():
            raise ValueError(f"{a.model}: already quantized; re-encoding a quantized checkpoint is lossy (use "
                             f"tools.coactivation --requantize for that) — quantize the BF16 master instead")
        if a.out.exists() and any(a.out.iterdir()):
            raise ValueError(f"{a.out}: output directory exists and is not empty")
        model = load_checkpoint(a.model)
        amax = None
        if a.calib_text:
            from tokenizers import Tokenizer
            ids = Tokenizer.from_file(str(a.model / "tokenizer.json")).encode(a.calib_text.read_text()).ids
            if not ids:
                raise ValueError(f"{a.calib_text}: no tokens")
            amax = calibrate(model, [torch.tensor([ids[:a.calib_tokens]])])
        write_checkpoint(model, a.out, a.quant, a.model, amax)
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{a.out}: {a.quant} checkpoint of {a.model}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
