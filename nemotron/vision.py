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
    return t.to(dtype) if dtype is not None else t


# ------------------------------------------------------------------------------------------------- stages
# The tower's weights as a list of *stages*, each a dict of tensors used together and then not again in
# one pass: the embedder, each ViT block, the projector's norms, then the projector's two matrices cut by
# output rows into pieces no larger than a block. One pass uses the stages in order, so a holder can keep
# them all on the device (`ResidentWeights`) or stream them through two device slots
# (`gpu_worker.weight_stream.StreamedWeights`); both give the same tensors to the same code.

def block_tensors(ckpt, cfg: VisionConfig, i: int, dtype) -> dict[str, torch.Tensor]:
    p, h, m = f"{TOWER}blocks.{i}.", cfg.hidden_size, cfg.mlp_hidden
    shapes = {"norm1.weight": (h,), "norm1.bias": (h,), "attn.qkv.weight": (3 * h, h), "attn.qkv.bias": (3 * h,),
              "attn.proj.weight": (h, h), "attn.proj.bias": (h,), "norm2.weight": (h,), "norm2.bias": (h,),
              "mlp.fc1.weight": (m, h), "mlp.fc1.bias": (m,), "mlp.fc2.weight": (h, m), "mlp.fc2.bias": (h,)}
    w = {k: _expect(ckpt, p + k, s, dtype) for k, s in shapes.items()}
    # C-RADIO has no layer scale; transformers' save_pretrained writes identity ones (layer_scale*.lambda1)
    # and timm checkpoints would name them ls*.gamma: applied when present
    for a, b in (("layer_scale1.lambda1", "layer_scale2.lambda1"), ("ls1.gamma", "ls2.gamma")):
        if ckpt.has(p + a):
            w["ls1"], w["ls2"] = _expect(ckpt, p + a, (h,), dtype), _expect(ckpt, p + b, (h,), dtype)
    return w


def _row_pieces(n_rows: int, row_bytes: int, max_bytes: int) -> list[tuple[int, int]]:
    per = max(1, max_bytes // max(1, row_bytes))
    return [(r, min(n_rows, r + per)) for r in range(0, n_rows, per)]


def tower_stages(ckpt, cfg: VisionConfig, dtype, max_stage_bytes: int | None = None) -> list[dict]:
    """[embed, block 0 .. block L-1, projector norms, W1 pieces..., W2 pieces...] as CPU tensors in `dtype`
    (the position table keeps its stored float type: it is resized in fp32)."""
    h = cfg.hidden_size
    stages = [{"embedder": _expect(ckpt, TOWER + "patch_generator.embedder.weight", (h, cfg.patch_dim), dtype),
               "pos_table": _expect(ckpt, TOWER + "patch_generator.pos_embed", (1, cfg.table_side ** 2, h), None),
               "prefix": _expect(ckpt, TOWER + "patch_generator.cls_token.token", (cfg.num_prefix_tokens, h),
                                 dtype)}]
    stages += [block_tensors(ckpt, cfg, i, dtype) for i in range(cfg.num_layers)]
    cat = cfg.merge_size ** 2 * h
    norms = {"proj_norm": _expect(ckpt, PROJECTOR + "0.weight", (cat,), dtype)}
    if cfg.has_final_norm:
        norms["final_norm.weight"] = _expect(ckpt, FINAL_NORM + "weight", (h,), dtype)
        norms["final_norm.bias"] = _expect(ckpt, FINAL_NORM + "bias", (h,), dtype)
    stages.append(norms)
    limit = max_stage_bytes or max(sum(t.nbytes for t in s.values()) for s in stages)
    w1 = _expect(ckpt, PROJECTOR + "1.weight", (cfg.projector_hidden, cat), dtype)
    w2 = _expect(ckpt, PROJECTOR + "3.weight", (cfg.out_hidden, cfg.projector_hidden), dtype)
    stages += [{"w1": w1[a:b].contiguous()} for a, b in _row_pieces(w1.shape[0], w1[0].nbytes, limit)]
    stages += [{"w2": w2[a:b].contiguous()} for a, b in _row_pieces(w2.shape[0], w2[0].nbytes, limit)]
    return stages


class ResidentWeights:
    """Every stage on the device for the process's life."""

    def __init__(self, stages: list[dict], device):
        self.stages = [{k: t.to(device) for k, t in s.items()} for s in stages]

    def __len__(self) -> int:
        return len(self.stages)

    def get(self, i: int) -> dict[str, torch.Tensor]:
        return self.stages[i]

    @property
    def device_bytes(self) -> int:
        return sum(t.nbytes for s in self.stages for t in s.values())


# ------------------------------------------------------------------------------------------------- math
MLP_ROWS = 4096       # the MLP runs on at most this many tokens at a time (its hidden is 4x the width)
POS_CHANNELS = 256    # the position table is resized this many channels at a time (fp32, up to side^2 each)


def block_forward(cfg: VisionConfig, w: dict, x: torch.Tensor) -> torch.Tensor:
    """Pre-norm ViT block on one image's sequence x (N, hidden): LayerNorm, fused qkv with bias, attention,
    proj; LayerNorm, fc1, exact GELU, fc2."""
    n, h = x.shape[0], cfg.hidden_size
    y = F.layer_norm(x, (h,), w["norm1.weight"], w["norm1.bias"], cfg.layer_norm_eps)
    q, k, v = F.linear(y, w["attn.qkv.weight"], w["attn.qkv.bias"]).chunk(3, dim=-1)
    # (1, heads, N, head_dim): the flash / memory-efficient kernels take 4-D inputs only (3-D falls back to the
    # math kernel, which materializes N x N scores per head: 11 GB at 13,312 patches)
    q, k, v = (t.view(1, n, cfg.num_heads, cfg.head_dim).transpose(1, 2) for t in (q, k, v))
    a = F.scaled_dot_product_attention(q, k, v)       # no mask within an image
    del q, k, v
    a = F.linear(a[0].transpose(0, 1).reshape(n, h), w["attn.proj.weight"], w["attn.proj.bias"])
    x = x + (a * w["ls1"] if "ls1" in w else a)
    del a
    out = torch.empty_like(x)
    for r in range(0, n, MLP_ROWS):
        xr = x[r:r + MLP_ROWS]
        y = F.layer_norm(xr, (h,), w["norm2.weight"], w["norm2.bias"], cfg.layer_norm_eps)
        y = F.linear(F.gelu(F.linear(y, w["mlp.fc1.weight"], w["mlp.fc1.bias"])), w["mlp.fc2.weight"],
                     w["mlp.fc2.bias"])
        out[r:r + MLP_ROWS] = xr + (y * w["ls2"] if "ls2" in w else y)
    return out


def pixel_shuffle(features: torch.Tensor, gh: int, gw: int, m: int = 2) -> torch.Tensor:
    """(gh*gw, C) row-major -> (gh/m * gw/m, m*m*C): token (i, j) holds F[m*i+a, m*j+b] for a, then b."""
    c = features.shape[-1]
    f = features.view(gh // m, m, gw // m, m, c).permute(0, 2, 1, 3, 4)
    return f.reshape((gh // m) * (gw // m), m * m * c)


def resize_position_table(table: torch.Tensor, side: int, gh: int, gw: int, dtype) -> torch.Tensor:
    """(gh*gw, hidden): the (1, side^2, hidden) table resized in fp32 to a square of the longer grid side, then
    its top-left gh x gw. Channels are independent, so it runs a slice of them at a time (bounded memory)."""
    t = table.reshape(1, side, side, -1).permute(0, 3, 1, 2)
    n = max(gh, gw)
    out = torch.empty(gh * gw, t.shape[1], dtype=dtype, device=table.device)
    for c in range(0, t.shape[1], POS_CHANNELS):
        r = F.interpolate(t[:, c:c + POS_CHANNELS].float(), size=(n, n), mode=POS_TABLE_MODE, align_corners=False)
        out[:, c:c + POS_CHANNELS] = r[0, :, :gh, :gw].flatten(1).transpose(0, 1)
    return out


class VisionTower:
    """The tower and projector over a weights holder (`ResidentWeights` by default, or a streamed one)."""

    POS_CACHE = 4        # position embeddings kept per grid (device memory: up to gh*gw*hidden each)

    def __init__(self, cfg: VisionConfig, weights, dtype=torch.float32):
        self.cfg, self.weights, self.dtype = cfg, weights, dtype
        self._pos_cache: dict[tuple[int, int], torch.Tensor] = {}

    @classmethod
    def from_checkpoint(cls, ckpt, model_config: dict, dtype=torch.float32, device="cpu", holder=ResidentWeights,
                        max_stage_bytes: int | None = None) -> "VisionTower":
        """holder(stages, device) keeps the weights: `ResidentWeights` or `gpu_worker.weight_stream.StreamedWeights`."""
        cfg = VisionConfig.from_checkpoint(ckpt, model_config)
        return cls(cfg, holder(tower_stages(ckpt, cfg, dtype, max_stage_bytes), device), dtype)

    @property
    def n_blocks_stage(self) -> range:
        return range(1, 1 + self.cfg.num_layers)

    def stage(self, i: int) -> dict[str, torch.Tensor]:
        return self.weights.get(i)

    def position_embedding(self, table: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
        key = (gh, gw)
        if key not in self._pos_cache:
            if len(self._pos_cache) >= self.POS_CACHE:
                self._pos_cache.pop(next(iter(self._pos_cache)))
            self._pos_cache[key] = resize_position_table(table, self.cfg.table_side, gh, gw, self.dtype)
        return self._pos_cache[key]

    def embed(self, w: dict, patches: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
        """(gh*gw, 3*P*P) normalized patches -> (prefix + gh*gw, hidden)."""
        e = F.linear(patches.to(w["embedder"].device, self.dtype), w["embedder"])
        e += self.position_embedding(w["pos_table"], gh, gw)
        return torch.cat([w["prefix"], e])

    @staticmethod
    def _grids(pixel_values, grid_hw) -> list[tuple[int, int]]:
        grids = [(int(a), int(b)) for a, b in torch.as_tensor(grid_hw).tolist()]
        if sum(gh * gw for gh, gw in grids) != pixel_values.shape[0]:
            raise VisionError(f"pixel_values holds {pixel_values.shape[0]} patches, image_grid_hw "
                              f"{sum(gh * gw for gh, gw in grids)}")
        return grids

    def features(self, pixel_values: torch.Tensor, grid_hw) -> list[torch.Tensor]:
        """The tower: per image its patch features (gh*gw, hidden), prefix tokens dropped. Images run as
        separate sequences with the blocks in the outer loop (each block's weights serve every image)."""
        grids = self._grids(pixel_values, grid_hw)
        w = self.stage(0)
        hs = [self.embed(w, p, gh, gw) for p, (gh, gw) in zip(pixel_values.split([a * b for a, b in grids]), grids)]
        for i in self.n_blocks_stage:
            w = self.stage(i)
            hs = [block_forward(self.cfg, w, h) for h in hs]
        return [h[self.cfg.num_prefix_tokens:] for h in hs]

    def project(self, features: list[torch.Tensor], grids) -> list[torch.Tensor]:
        """Per image its features -> its (gh*gw/4, LM hidden) embeddings for the `<image>` positions."""
        cfg = self.cfg
        for gh, gw in grids:
            if gh % cfg.merge_size or gw % cfg.merge_size:
                raise VisionError(f"grid {gh}x{gw} is not a multiple of the merge size {cfg.merge_size}")
        i = 1 + cfg.num_layers
        w = self.stage(i)
        merged = []
        for f, (gh, gw) in zip(features, grids):
            if "final_norm.weight" in w:
                f = F.layer_norm(f, (cfg.hidden_size,), w["final_norm.weight"], w["final_norm.bias"],
                                 cfg.layer_norm_eps)
            s = pixel_shuffle(f, gh, gw, cfg.merge_size)
            # RMSNorm in fp32 with the weight multiplied before the cast back, as transformers does
            s32 = s.float()
            s32 = s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + cfg.projector_eps)
            merged.append((w["proj_norm"].float() * s32).to(self.dtype))
        mids = [torch.empty(m.shape[0], cfg.projector_hidden, dtype=self.dtype, device=m.device) for m in merged]
        outs = [torch.empty(m.shape[0], cfg.out_hidden, dtype=self.dtype, device=m.device) for m in merged]
        r = 0
        while r < cfg.projector_hidden:
            i += 1
            w1 = self.stage(i)["w1"]
            for s, mid in zip(merged, mids):
                mid[:, r:r + w1.shape[0]] = torch.relu(F.linear(s, w1)).square()
            r += w1.shape[0]
        r = 0
        while r < cfg.out_hidden:
            i += 1
            w2 = self.stage(i)["w2"]
            for mid, out in zip(mids, outs):
                out[:, r:r + w2.shape[0]] = F.linear(mid, w2)
            r += w2.shape[0]
        return outs

    def __call__(self, pixel_values: torch.Tensor, grid_hw) -> list[torch.Tensor]:
        """Normalized patches of one request's images -> per image its projected embeddings."""
        grids = self._grids(pixel_values, grid_hw)
        return self.project(self.features(pixel_values, grid_hw), grids)

    def activation_bytes(self, n_patches: int) -> int:
        """An upper estimate of the device memory one image of n_patches needs beyond the weights: the residual
        stream, qkv, attention output, one MLP slice, the resized position table slice and the projector's
        intermediates, in the compute dtype (fp32 for the table slice and the RMSNorm)."""
        c, e = self.cfg, torch.tensor([], dtype=self.dtype).element_size()
        n = n_patches + c.num_prefix_tokens
        side = math.isqrt(n_patches) + 1
        block = n * c.hidden_size * e * 7 + min(n, MLP_ROWS) * c.mlp_hidden * e * 2
        table = side * side * POS_CHANNELS * 4 * 2 + n_patches * c.hidden_size * e * 2
        proj = n_patches // c.merge_size ** 2 * (c.merge_size ** 2 * c.hidden_size * (4 + e)
                                                    + c.projector_hidden * e * 2 + c.out_hidden * e)
        patches = n_patches * c.patch_dim * (4 + e)          # the fp32 patches as sent, and their cast
        return max(block, table, proj) + n * c.hidden_size * e * 2 + patches
