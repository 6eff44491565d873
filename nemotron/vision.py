"""The C-RADIO vision tower and the image projector of NemotronH Omni / VL, in plain PyTorch.

Math as transformers 5.24 (`RadioModel` inside `NemotronH_Omni_Reasoning_V3`, `get_image_features`); tensors
read by their published names (`vision_model.radio_model.model.…`, `mlp1.…`,
`vision_projector.vision_final_layernorm.…`) through any reader with `get(name)` / `has(name)`, such as
`nemotron.checkpoint.Checkpoint`. Layers hold tensors, not nn.Modules, like the rest of `nemotron/`.

Several images are run one sequence each (prefix tokens + their patches), blocks in the outer loop: that is
the block-diagonal attention of transformers' packed forward, and the order a streamed tower needs (each
block's weights are used for every image before the next block's arrive).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

TOWER = "vision_model.radio_model.model."
PROJECTOR = "mlp1."
FINAL_NORM = "vision_projector.vision_final_layernorm."
# mode used to resize the CPE position table to the image's grid (transformers / RADIO: bilinear, no antialias)
POS_TABLE_MODE = "bilinear"
# timm model names in released RADIO configs (`vision_config.args.model`) -> attention heads
TIMM_HEADS = {"vit_huge_patch16_224": 16, "vit_large_patch16_224": 16, "vit_base_patch16_224": 12}


class VisionError(ValueError):
    pass


@dataclass
class VisionConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    mlp_hidden: int
    patch_size: int
    patch_dim: int
    num_prefix_tokens: int          # CLS tokens + registers: no position embedding, dropped after the tower
    table_side: int                 # the CPE table is table_side x table_side positions
    layer_norm_eps: float = 1e-6
    merge_size: int = 2             # 1 / downsample_ratio
    projector_hidden: int = 0
    out_hidden: int = 0             # the language model's hidden size
    projector_eps: float = 1e-5
    has_final_norm: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_checkpoint(cls, ckpt, model_config: dict) -> "VisionConfig":
        """Shapes from the tensors; heads, patch size and eps from `config.json` (transformers or released form)."""
        vc = model_config.get("vision_config") or {}
        args = vc.get("args") or {}
        heads = vc.get("num_attention_heads") or args.get("num_attention_heads") or TIMM_HEADS.get(args.get("model"))
        if not heads:
            raise VisionError("vision_config names no num_attention_heads and no known args.model "
                              f"({args.get('model')!r})")
        embedder = ckpt.get(TOWER + "patch_generator.embedder.weight")
        hidden, patch_dim = embedder.shape
        patch_size = int(vc.get("patch_size", args.get("patch_size", 16)))
        if patch_dim != 3 * patch_size ** 2:
            raise VisionError(f"patch embedder takes {patch_dim} values, expected 3*{patch_size}^2")
        n_pos = ckpt.get(TOWER + "patch_generator.pos_embed").shape[-2]
        side = math.isqrt(n_pos)
        if side * side != n_pos:
            raise VisionError(f"pos_embed has {n_pos} positions, not a square table")
        n_layers = 0
        while ckpt.has(f"{TOWER}blocks.{n_layers}.attn.qkv.weight"):
            n_layers += 1
        if n_layers == 0:
            raise VisionError(f"no {TOWER}blocks.0.attn.qkv.weight in the checkpoint")
        lin2 = ckpt.get(PROJECTOR + "3.weight")
        return cls(
            hidden_size=hidden, num_layers=n_layers, num_heads=int(heads),
            mlp_hidden=ckpt.get(f"{TOWER}blocks.0.mlp.fc1.weight").shape[0],
            patch_size=patch_size, patch_dim=patch_dim,
            num_prefix_tokens=ckpt.get(TOWER + "patch_generator.cls_token.token").shape[0],
            table_side=side, layer_norm_eps=float(vc.get("layer_norm_eps", 1e-6)),
            merge_size=round(1 / float(model_config.get("downsample_ratio", 0.5))),
            projector_hidden=lin2.shape[1], out_hidden=lin2.shape[0],
            has_final_norm=ckpt.has(FINAL_NORM + "weight"),
        )


def _expect(ckpt, name, shape, dtype):
    t = ckpt.get(name)
    if tuple(t.shape) != tuple(shape):
        raise VisionError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if not t.is_floating_point():
        raise VisionError(f"{name} has dtype {t.dtype}, expected a float tensor (vision weights are never quantized)")
    return t.to(dtype)


class VisionBlock:
    """Pre-norm ViT block: LayerNorm, fused qkv with bias, attention, proj; LayerNorm, fc1, exact GELU, fc2."""

    def __init__(self, ckpt, cfg: VisionConfig, i: int, dtype):
        p, h, m = f"{TOWER}blocks.{i}.", cfg.hidden_size, cfg.mlp_hidden
        g = lambda name, shape: _expect(ckpt, p + name, shape, dtype)  # noqa: E731
        self.cfg = cfg
        self.norm1_w, self.norm1_b = g("norm1.weight", (h,)), g("norm1.bias", (h,))
        self.qkv_w, self.qkv_b = g("attn.qkv.weight", (3 * h, h)), g("attn.qkv.bias", (3 * h,))
        self.proj_w, self.proj_b = g("attn.proj.weight", (h, h)), g("attn.proj.bias", (h,))
        self.norm2_w, self.norm2_b = g("norm2.weight", (h,)), g("norm2.bias", (h,))
        self.fc1_w, self.fc1_b = g("mlp.fc1.weight", (m, h)), g("mlp.fc1.bias", (m,))
        self.fc2_w, self.fc2_b = g("mlp.fc2.weight", (h, m)), g("mlp.fc2.bias", (h,))
        # C-RADIO has no layer scale; transformers' save_pretrained writes identity ones (layer_scale*.lambda1)
        # and timm checkpoints would name them ls*.gamma: applied when present
        self.ls1 = self.ls2 = None
        for a, b in (("layer_scale1.lambda1", "layer_scale2.lambda1"), ("ls1.gamma", "ls2.gamma")):
            if ckpt.has(p + a):
                self.ls1, self.ls2 = g(a, (h,)), g(b, (h,))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: (N, hidden), one image's sequence."""
        cfg = self.cfg
        n = x.shape[0]
        y = F.layer_norm(x, (cfg.hidden_size,), self.norm1_w, self.norm1_b, cfg.layer_norm_eps)
        q, k, v = F.linear(y, self.qkv_w, self.qkv_b).chunk(3, dim=-1)
        q, k, v = (t.view(n, cfg.num_heads, cfg.head_dim).transpose(0, 1) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v)       # memory-efficient on CUDA; no mask within an image
        a = F.linear(a.transpose(0, 1).reshape(n, cfg.hidden_size), self.proj_w, self.proj_b)
        x = x + (a * self.ls1 if self.ls1 is not None else a)
        y = F.layer_norm(x, (cfg.hidden_size,), self.norm2_w, self.norm2_b, cfg.layer_norm_eps)
        y = F.linear(F.gelu(F.linear(y, self.fc1_w, self.fc1_b)), self.fc2_w, self.fc2_b)
        return x + (y * self.ls2 if self.ls2 is not None else y)


def pixel_shuffle(features: torch.Tensor, gh: int, gw: int, m: int = 2) -> torch.Tensor:
    """(gh*gw, C) row-major -> (gh/m * gw/m, m*m*C): token (i, j) holds F[m*i+a, m*j+b] for a, then b."""
    c = features.shape[-1]
    f = features.view(gh // m, m, gw // m, m, c).permute(0, 2, 1, 3, 4)
    return f.reshape((gh // m) * (gw // m), m * m * c)


class VisionTower:
    def __init__(self, ckpt, cfg: VisionConfig, dtype=torch.float32):
        h = cfg.hidden_size
        self.cfg, self.dtype = cfg, dtype
        self.embedder = _expect(ckpt, TOWER + "patch_generator.embedder.weight", (h, cfg.patch_dim), dtype)
        self.pos_table = _expect(ckpt, TOWER + "patch_generator.pos_embed", (1, cfg.table_side ** 2, h), torch.float32)
        self.prefix = _expect(ckpt, TOWER + "patch_generator.cls_token.token", (cfg.num_prefix_tokens, h), dtype)
        self.blocks = [VisionBlock(ckpt, cfg, i, dtype) for i in range(cfg.num_layers)]
        self.final_norm = None
        if cfg.has_final_norm:
            self.final_norm = (_expect(ckpt, FINAL_NORM + "weight", (h,), dtype),
                               _expect(ckpt, FINAL_NORM + "bias", (h,), dtype))
        cat = cfg.merge_size ** 2 * h
        self.proj_norm = _expect(ckpt, PROJECTOR + "0.weight", (cat,), dtype)
        self.proj_w1 = _expect(ckpt, PROJECTOR + "1.weight", (cfg.projector_hidden, cat), dtype)
        self.proj_w2 = _expect(ckpt, PROJECTOR + "3.weight", (cfg.out_hidden, cfg.projector_hidden), dtype)
        self._pos_cache: dict[tuple[int, int], torch.Tensor] = {}

    @classmethod
    def from_checkpoint(cls, ckpt, model_config: dict, dtype=torch.float32) -> "VisionTower":
        return cls(ckpt, VisionConfig.from_checkpoint(ckpt, model_config), dtype)

    def position_embedding(self, gh: int, gw: int) -> torch.Tensor:
        """(gh*gw, hidden): the table resized (fp32) to a square of the longer side, then its top-left gh x gw."""
        key = (gh, gw)
        if key not in self._pos_cache:
            s = self.cfg.table_side
            t = self.pos_table.reshape(1, s, s, -1).permute(0, 3, 1, 2)
            side = max(gh, gw)
            t = F.interpolate(t, size=(side, side), mode=POS_TABLE_MODE, align_corners=False)
            t = t.to(self.dtype)[..., :gh, :gw]
            self._pos_cache[key] = t.flatten(2)[0].transpose(0, 1).contiguous()
        return self._pos_cache[key]

    def embed(self, patches: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
        """(gh*gw, 3*P*P) normalized patches -> (prefix + gh*gw, hidden)."""
        e = F.linear(patches.to(self.dtype), self.embedder) + self.position_embedding(gh, gw)
        return torch.cat([self.prefix, e])

    def features(self, pixel_values: torch.Tensor, grid_hw) -> list[torch.Tensor]:
        """The tower: per image its patch features (gh*gw, hidden), prefix tokens dropped."""
        grids = [(int(a), int(b)) for a, b in torch.as_tensor(grid_hw).tolist()]
        sizes = [gh * gw for gh, gw in grids]
        if sum(sizes) != pixel_values.shape[0]:
            raise VisionError(f"pixel_values holds {pixel_values.shape[0]} patches, image_grid_hw {sum(sizes)}")
        hs = [self.embed(p, gh, gw) for p, (gh, gw) in zip(pixel_values.split(sizes), grids)]
        for block in self.blocks:
            hs = [block(h) for h in hs]
        return [h[self.cfg.num_prefix_tokens:] for h in hs]

    def project(self, features: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
        """One image's features -> its (gh*gw/4, LM hidden) embeddings for the `<image>` positions."""
        cfg = self.cfg
        if gh % cfg.merge_size or gw % cfg.merge_size:
            raise VisionError(f"grid {gh}x{gw} is not a multiple of the merge size {cfg.merge_size}")
        if self.final_norm is not None:
            features = F.layer_norm(features, (cfg.hidden_size,), *self.final_norm, cfg.layer_norm_eps)
        s = pixel_shuffle(features, gh, gw, cfg.merge_size)
        # RMSNorm in fp32 with the weight multiplied before the cast back, as transformers does
        s32 = s.float()
        s32 = s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + cfg.projector_eps)
        s = (self.proj_norm.float() * s32).to(self.dtype)
        return F.linear(torch.relu(F.linear(s, self.proj_w1)).square(), self.proj_w2)

    def __call__(self, pixel_values: torch.Tensor, grid_hw) -> list[torch.Tensor]:
        """Normalized patches of one request's images -> per image its projected embeddings."""
        grids = [(int(a), int(b)) for a, b in torch.as_tensor(grid_hw).tolist()]
        return [self.project(f, gh, gw) for f, (gh, gw) in zip(self.features(pixel_values, grid_hw), grids)]
