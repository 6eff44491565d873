"""Synthetic NemotronH Omni checkpoint (`omni` preset): a tiny C-RADIO tower, the `mlp1` projector and the
`tiny` NemotronH, in the published Omni layout.

    python -m tools.synth_vision --out DIR [--seed S] [--tiled]

Layout as released: the language model's tensors under `language_model.`, the tower under
`vision_model.radio_model.` (fused qkv, `patch_generator.*`, `input_conditioner.*`, `summary_idxs`), the projector
as `mlp1.{0,1,3}`; `config.json` with the released field names (`llm_config`, `vit_hidden_size`,
`img_context_token_id`, `vision_config.args.{min,max}_num_patches`) which transformers maps on load; a
`preprocessor_config.json` with released `norm_mean`/`norm_std` names; the `tiny` tokenizer with `<image>`
and `<img>` at ids 18 and 19 (the released ids) and `</img>` in the last reserved slot, and a chat template that
renders an image content part as `<image>`. The language model is bf16 (transformers, the reference, cannot
read the quantized formats). Tower geometry: hidden 64, 2 blocks, 4 heads, 16x16 position table (256 px).

`--tiled` (`synthesize_omni(..., tiled=True)`, the `omni-tiled` checkpoint): the same tensors in the layout of
Nemotron Nano 12B v2 VL, whose images use the static tiled scheme (`nemotron.vision_tiles`): `config.json`
with `architectures`/`model_type` `NemotronH_Nano_VL_V2`, `vision_config.args` without `min_num_patches`
(what selects the scheme), `force_image_size` and `use_thumbnail`; `preprocessor_config.json` as the
checkpoint's `NemotronNanoVLV2ImageProcessor` takes it (`image_size`, `max_num_tiles`, `use_thumbnail`,
`patch_size`, `downsample_ratio`, `norm_mean`/`norm_std`). Tiles of 128 px (16 tokens each) and at most 6 tiles
keep prompts small; the release has 512 px, 256 tokens and 12.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nemotron.vision_preprocess import IMAGE_END, IMAGE_START, IMAGE_TOKEN, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from tools.synth import synthesize
from tools.synth_weights import gen

VISION = dict(hidden=64, layers=2, heads=4, mlp=256, patch=16, table_side=16, n_cls=3, n_registers=7,
              projector_hidden=256, min_num_patches=64, max_num_patches=256)
TILED = dict(image_size=128, max_num_tiles=6, use_thumbnail=True)
IMAGE_TOKEN_ID, IMAGE_START_ID = 18, 19          # released ids; "</img>" takes the last vocabulary slot
TOWER = "vision_model.radio_model."


def vision_tensors(seed: int, lm_hidden: int) -> dict[str, torch.Tensor]:
    """O(1)-scaled random tower and projector (bf16 like the release), one generator per tensor name."""
    v = VISION
    h, m, pd = v["hidden"], v["mlp"], 3 * v["patch"] ** 2
    shapes = {
        "model.patch_generator.embedder.weight": (h, pd),
        "model.patch_generator.video_embedder.weight": (h, 2 * pd),
        "model.patch_generator.pos_embed": (1, v["table_side"] ** 2, h),
        "model.patch_generator.cls_token.token": (v["n_cls"] + v["n_registers"], h),
    }
    for i in range(v["layers"]):
        b = f"model.blocks.{i}."
        shapes |= {b + "norm1.weight": (h,), b + "norm1.bias": (h,), b + "attn.qkv.weight": (3 * h, h),
                   b + "attn.qkv.bias": (3 * h,), b + "attn.proj.weight": (h, h), b + "attn.proj.bias": (h,),
                   b + "norm2.weight": (h,), b + "norm2.bias": (h,), b + "mlp.fc1.weight": (m, h),
                   b + "mlp.fc1.bias": (m,), b + "mlp.fc2.weight": (h, m), b + "mlp.fc2.bias": (h,)}
    out = {}
    for name, shape in shapes.items():
        g = gen(seed, TOWER + name)
        x = torch.randn(shape, generator=g)
        if name.endswith("norm1.weight") or name.endswith("norm2.weight"):
            x = 1 + 0.2 * x
        elif len(shape) == 2 and "token" not in name:
            x = x / math.sqrt(shape[1])
        else:
            x = x * (0.5 if "pos_embed" in name or "token" in name else 0.1)
        out[TOWER + name] = x.to(torch.bfloat16)
    out[TOWER + "input_conditioner.norm_mean"] = torch.tensor(OPENAI_CLIP_MEAN).view(3, 1, 1)
    out[TOWER + "input_conditioner.norm_std"] = torch.tensor(OPENAI_CLIP_STD).view(3, 1, 1)
    out[TOWER + "summary_idxs"] = torch.tensor([0, 1], dtype=torch.int64)
    cat, ph = 4 * h, v["projector_hidden"]
    out["mlp1.0.weight"] = (1 + 0.2 * torch.randn(cat, generator=gen(seed, "mlp1.0.weight"))).to(torch.bfloat16)
    out["mlp1.1.weight"] = (torch.randn(ph, cat, generator=gen(seed, "mlp1.1.weight"))
                            / math.sqrt(cat)).to(torch.bfloat16)
    # relu^2 of unit-scale inputs has mean square ~1.5; 0.5/sqrt(ph) keeps image embeddings near text-embedding scale
    out["mlp1.3.weight"] = (torch.randn(lm_hidden, ph, generator=gen(seed, "mlp1.3.weight"))
                            * 0.5 / math.sqrt(ph)).to(torch.bfloat16)
    return out


def omni_chat_template(text_template: str) -> str:
    """The tiny chat template, with user content that may be a list of parts: an image part becomes `<image>`."""
    macro = ("{%- macro render_content(c) -%}{%- if c is string -%}{{- c -}}{%- else -%}{%- for p in c -%}"
             "{%- if p['type'] in ('image', 'image_url') -%}{{- '" + IMAGE_TOKEN + "' -}}"
             "{%- elif p['type'] == 'text' -%}{{- p['text'] -}}{%- endif -%}{%- endfor -%}{%- endif -%}"
             "{%- endmacro -%}\n")
    user_line = "{%- set content = m['content'] -%}"
    if text_template.count(user_line) != 1:
        raise RuntimeError("the tiny chat template changed: cannot find its user-content line")
    return macro + text_template.replace(user_line, "{%- set content = render_content(m['content']) -%}")


def patch_tokenizer(out: Path, vocab_size: int) -> int:
    """Name the image tokens in the tiny tokenizer's files; returns the `</img>` id."""
    end_id = vocab_size - 1
    renames = {IMAGE_TOKEN_ID: IMAGE_TOKEN, IMAGE_START_ID: IMAGE_START}
    tj = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = tj["model"]["vocab"]
    by_id = {i: s for s, i in vocab.items()}
    for i, new in renames.items():
        if not by_id[i].startswith("<SPECIAL_"):
            raise RuntimeError(f"tiny tokenizer id {i} is {by_id[i]!r}, not a free special slot")
        vocab[new] = vocab.pop(by_id[i])
    if not by_id[end_id].startswith("<|reserved_"):
        raise RuntimeError(f"tiny tokenizer id {end_id} is {by_id[end_id]!r}, not a reserved slot")
    vocab[IMAGE_END] = vocab.pop(by_id[end_id])
    for a in tj["added_tokens"]:
        if a["id"] in renames:
            a["content"] = renames[a["id"]]
    tj["added_tokens"].append({"id": end_id, "content": IMAGE_END, "single_word": False, "lstrip": False,
                               "rstrip": False, "normalized": False, "special": True})
    (out / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    tc = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    for i, new in renames.items():
        tc["added_tokens_decoder"][str(i)]["content"] = new
    tc["added_tokens_decoder"][str(end_id)] = {"content": IMAGE_END, "lstrip": False, "normalized": False,
                                               "rstrip": False, "single_word": False, "special": True}
    tc["chat_template"] = omni_chat_template(tc["chat_template"])
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return end_id


def synthesize_omni(out, seed: int = 0, tiled: bool = False, **synth_knobs) -> dict:
    """Write the omni checkpoint to `out` (`tiled`: the Nano 12B v2 VL layout with static tiles); returns its
    config dict."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        lm_cfg = synthesize(tmp, preset="tiny", quant="bf16", seed=seed, **synth_knobs)
        tmp = Path(tmp)
        weight_map = {}
        for shard in sorted(tmp.glob("*.safetensors")):
            with safe_open(shard, framework="pt") as f:
                tensors = {"language_model." + k: f.get_tensor(k) for k in f.keys()}
            save_file(tensors, out / shard.name, metadata={"format": "pt"})
            weight_map |= dict.fromkeys(tensors, shard.name)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            shutil.copy(tmp / name, out / name)
    vt = vision_tensors(seed, lm_cfg["hidden_size"])
    save_file(vt, out / "model-vision.safetensors", metadata={"format": "pt"})
    weight_map |= dict.fromkeys(vt, "model-vision.safetensors")
    total_bytes = 0
    for shard in sorted(set(weight_map.values())):
        with safe_open(out / shard, framework="pt") as f:
            total_bytes += sum(f.get_tensor(k).nbytes for k in f.keys())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    end_id = patch_tokenizer(out, lm_cfg["vocab_size"])
    v = VISION
    cfg = {
        "architectures": ["NemotronH_Omni_Reasoning_V3"], "model_type": "nemotron_h_omni",
        "llm_config": lm_cfg,
        "vision_config": {
            "model_type": "radio", "hidden_size": v["hidden"], "num_hidden_layers": v["layers"],
            "num_attention_heads": v["heads"], "mlp_ratio": v["mlp"] / v["hidden"], "layer_norm_eps": 1e-6,
            "patch_size": v["patch"], "max_img_size": v["patch"] * v["table_side"], "num_cls_tokens": v["n_cls"],
            "num_registers": v["n_registers"], "video_temporal_patch_size": 2, "qkv_bias": True,
            "args": {"model": "synthetic_tiny", "min_num_patches": v["min_num_patches"],
                     "max_num_patches": v["max_num_patches"], "register_multiple": v["n_cls"] + v["n_registers"]},
        },
        "vit_hidden_size": v["hidden"], "projector_hidden_size": v["projector_hidden"], "downsample_ratio": 0.5,
        "patch_size": v["patch"], "ps_version": "v2", "image_tag_type": "internvl", "force_image_size": 512,
        "img_context_token_id": IMAGE_TOKEN_ID, "image_start_token_id": IMAGE_START_ID,
        "image_end_token_id": end_id, "video_temporal_patch_size": 2,
        "norm_mean": list(OPENAI_CLIP_MEAN), "norm_std": list(OPENAI_CLIP_STD),
    }
    if tiled:
        t = TILED
        cfg["architectures"], cfg["model_type"] = ["NemotronH_Nano_VL_V2"], "NemotronH_Nano_VL_V2"
        for key in ("min_num_patches", "max_num_patches"):
            del cfg["vision_config"]["args"][key]
        cfg["force_image_size"], cfg["use_thumbnail"] = t["image_size"], t["use_thumbnail"]
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (out / "preprocessor_config.json").write_text(json.dumps({
            "image_processor_type": "NemotronNanoVLV2ImageProcessor", "processor_class": "NemotronNanoVLV2Processor",
            "image_size": t["image_size"], "patch_size": v["patch"], "downsample_ratio": 0.5,
            "max_num_tiles": t["max_num_tiles"], "use_thumbnail": t["use_thumbnail"],
            "norm_mean": list(OPENAI_CLIP_MEAN), "norm_std": list(OPENAI_CLIP_STD)}, indent=2) + "\n")
        return cfg
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "NemotronH_Omni_Reasoning_V3ImageProcessor",
        "processor_class": "NemotronH_Omni_Reasoning_V3Processor",
        "patch_size": v["patch"], "downsample_ratio": 0.5, "min_num_patches": v["min_num_patches"],
        "max_num_patches": v["max_num_patches"], "max_model_len": 4096,
        "norm_mean": list(OPENAI_CLIP_MEAN), "norm_std": list(OPENAI_CLIP_STD)}, indent=2) + "\n")
    return cfg


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiled", action="store_true",
                    help="the Nano 12B v2 VL layout: images in static tiles (omni-tiled)")
    a = ap.parse_args(argv)
    synthesize_omni(a.out, seed=a.seed, tiled=a.tiled)
    print(f"wrote the {'omni-tiled' if a.tiled else 'omni'} checkpoint to {a.out}")


if __name__ == "__main__":
    main()
