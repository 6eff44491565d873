"""Image preprocessing for NemotronH Omni / VL, dynamic-resolution scheme.

The same numbers as transformers 5.24's `NemotronH_Omni_Reasoning_V3ImageProcessor`: the patch grid within
[min_num_patches, budget], a float32 bicubic antialiased resize (what torchvision's `resize` runs for float
tensors), CLIP normalization with the mean and std pre-scaled by 255 (transformers fuses rescale into
normalize, and the fused form rounds differently from x/255 then normalize), and patches laid out row-major
over the grid, each channel-major (C, P, P). Pillow only decodes.

The older static tiled scheme (Nemotron Nano 12B v2 VL) is in `nemotron.vision_tiles`; `ImageGeometry.scheme`
says which one a checkpoint uses (`image_scheme`, the one place that decides) and `preprocess` dispatches on it.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

IMAGE_TOKEN = "<image>"
IMAGE_START = "<img>"
IMAGE_END = "</img>"


DYNAMIC, TILED = "dynamic", "tiled"
TILED_PROCESSORS = ("NemotronNanoVLV2ImageProcessor",)


def image_scheme(preprocessor: dict | None = None, model_config: dict | None = None) -> str:
    """`"dynamic"` or `"tiled"`: the one place that decides.

    With the model's config.json and its `vision_config.args` (the released RADIO remote-code layout, kept by
    transformers' `save_pretrained`): vLLM's rule, dynamic iff `args` has `min_num_patches` (released Omni /
    Super VL), static tiles otherwise (Nano 12B v2 VL). Without them (a caller that has only
    `preprocessor_config.json`, or a config with no `args`): dynamic if the preprocessor file names
    `min_num_patches`, tiled if it names the tiled processor or its knobs (`max_num_tiles`, `use_thumbnail`),
    dynamic otherwise (what this engine did before)."""
    vc = (model_config or {}).get("vision_config")
    if isinstance(vc, dict) and isinstance(vc.get("args"), dict):
        return DYNAMIC if "min_num_patches" in vc["args"] else TILED
    d = preprocessor or {}
    if "min_num_patches" in d:
        return DYNAMIC
    if d.get("image_processor_type") in TILED_PROCESSORS or "max_num_tiles" in d or "use_thumbnail" in d:
        return TILED
    return DYNAMIC


@dataclass
class ImageGeometry:
    patch_size: int = 16
    downsample_ratio: float = 0.5
    min_num_patches: int = 1024
    max_num_patches: int = 13312      # 0 disables the cap
    max_model_len: int = 16384
    image_mean: tuple = field(default=OPENAI_CLIP_MEAN)
    image_std: tuple = field(default=OPENAI_CLIP_STD)
    scheme: str = DYNAMIC             # or TILED (nemotron.vision_tiles)
    image_size: int = 512             # tiled: tile side in px
    max_num_tiles: int = 12           # tiled: tiles per image before the thumbnail
    use_thumbnail: bool = True        # tiled: append the whole image as one more tile when there are several

    @property
    def merge_size(self) -> int:
        return round(1 / self.downsample_ratio)

    @property
    def tokens_per_tile(self) -> int:
        return (self.image_size // self.patch_size) ** 2 // self.merge_size ** 2

    @classmethod
    def from_dict(cls, d: dict, model_config: dict | None = None) -> "ImageGeometry":
        """From a `preprocessor_config.json` (released files name the statistics `norm_mean`/`norm_std`) and,
        if given, the model's config.json: it decides the scheme (`image_scheme`) and fills what the
        preprocessor file lacks (`force_image_size`, `use_thumbnail`, `norm_mean`/`norm_std`, the patch limits
        in `vision_config.args`), as vLLM reads them."""
        d = dict(d or {})
        mc = model_config or {}
        g = cls(scheme=image_scheme(d, model_config))
        vc = mc.get("vision_config") if isinstance(mc.get("vision_config"), dict) else {}
        args = vc.get("args") if isinstance(vc.get("args"), dict) else {}
        fallback = {"patch_size": mc.get("patch_size"), "downsample_ratio": mc.get("downsample_ratio"),
                    "image_size": mc.get("force_image_size"), "use_thumbnail": mc.get("use_thumbnail"),
                    "max_num_tiles": mc.get("max_num_tiles"), "min_num_patches": args.get("min_num_patches"),
                    "max_num_patches": args.get("max_num_patches"),
                    "norm_mean": mc.get("norm_mean"), "norm_std": mc.get("norm_std")}
        aliases = {"norm_mean": "image_mean", "norm_std": "image_std"}
        for key, v in fallback.items():
            if v is not None and d.get(key) is None and d.get(aliases.get(key, key)) is None:
                d[key] = v
        for key in ("patch_size", "downsample_ratio", "min_num_patches", "max_num_patches", "max_model_len",
                    "image_size", "max_num_tiles"):
            if d.get(key) is not None:
                setattr(g, key, type(getattr(g, key))(d[key]))
        if d.get("use_thumbnail") is not None:
            g.use_thumbnail = bool(d["use_thumbnail"])
        mean = d.get("image_mean", d.get("norm_mean"))
        std = d.get("image_std", d.get("norm_std"))
        if mean is not None:
            g.image_mean = tuple(float(x) for x in mean)
        if std is not None:
            g.image_std = tuple(float(x) for x in std)
        return g

    @classmethod
    def from_model_dir(cls, model_dir) -> "ImageGeometry":
        """`preprocessor_config.json` and `config.json` of a checkpoint directory (either may be missing)."""
        import json
        from pathlib import Path

        def read(name):
            f = Path(model_dir) / name
            return json.loads(f.read_text()) if f.exists() else {}
        return cls.from_dict(read("preprocessor_config.json"), read("config.json") or None)


def patch_grid(height: int, width: int, patch_size: int, merge_size: int,
               min_num_patches: int, max_num_patches: int) -> tuple[int, int]:
    """(grid_h, grid_w) the image is resized to: near its own grid, scaled into [min, max] patches, each side a
    multiple of merge_size."""
    # round(x + 0.5) is floor(x) + 1 for non-integral x and x otherwise (ties to even)
    gh = round(height / patch_size + 0.5)
    gw = round(width / patch_size + 0.5)
    factor = min(math.sqrt(max_num_patches / (gh * gw)), 1.0)
    gh, gw = math.floor(factor * gh), math.floor(factor * gw)
    if gh == 0 or gw == 0:
        # transformers divides by zero here (or makes an empty image); an API caller needs a reason
        raise ValueError(f"image of {width}x{height} px is too elongated for a budget of {max_num_patches} patches")
    if max_num_patches > min_num_patches and gh * gw < min_num_patches:
        factor = math.sqrt(min_num_patches / (gh * gw))
        gh, gw = math.ceil(factor * gh), math.ceil(factor * gw)
    if r := gh % merge_size:
        gh = gh + merge_size - r if (gh + merge_size - r) * gw <= max_num_patches else max(merge_size, gh - r)
    if r := gw % merge_size:
        gw = gw + merge_size - r if gh * (gw + merge_size - r) <= max_num_patches else max(merge_size, gw - r)
    return gh, gw


def patch_budget(geom: ImageGeometry, n_images: int) -> int:
    """Per-image patch cap of one call: every image gets the same, from the context length, clamped."""
    budget = max((geom.max_model_len - 4) * geom.merge_size ** 2, geom.min_num_patches * n_images)
    if geom.max_num_patches:
        budget = min(budget, geom.max_num_patches)
    return max(budget, geom.min_num_patches)


def decode_image(data: bytes) -> torch.Tensor:
    """Encoded image bytes -> uint8 (3, H, W) RGB; transparency composited onto white as transformers does."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        im.load()
        if "A" in im.getbands() or im.info.get("transparency") is not None:
            rgba = im.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            rgb = Image.alpha_composite(white, rgba).convert("RGB")
        else:
            rgb = im.convert("RGB")
        arr = np.array(rgb)
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


def image_to_patches(image: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(C, H, W) -> (gh*gw, C*P*P): row-major over the grid, each patch channel-major."""
    c, h, w = image.shape
    gh, gw = h // patch_size, w // patch_size
    p = image.reshape(c, gh, patch_size, gw, patch_size).permute(1, 3, 0, 2, 4)
    return p.reshape(gh * gw, c * patch_size * patch_size)


def preprocess_one(image: torch.Tensor, geom: ImageGeometry, budget: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """uint8 (3, H, W) -> (patches (gh*gw, 3*P*P) fp32, (gh, gw))."""
    if image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"expected a (3, H, W) RGB image, got shape {tuple(image.shape)}")
    _, height, width = image.shape
    ps = geom.patch_size
    gh, gw = patch_grid(height, width, ps, geom.merge_size, geom.min_num_patches, budget)
    x = image.to(torch.float32).unsqueeze(0)
    if (height, width) != (gh * ps, gw * ps):
        # float32 so the bicubic overshoot is kept, not clamped back to 0..255
        x = F.interpolate(x, size=(gh * ps, gw * ps), mode="bicubic", align_corners=False, antialias=True)
    # transformers' fused rescale+normalize: mean and std in fp32, multiplied by 1/rescale_factor (= 255.0)
    scale = 1.0 / (1 / 255)
    mean = (torch.tensor(geom.image_mean, dtype=torch.float32) * scale).view(-1, 1, 1)
    std = (torch.tensor(geom.image_std, dtype=torch.float32) * scale).view(-1, 1, 1)
    x = x[0].sub(mean).div_(std)
    return image_to_patches(x, ps), (gh, gw)


def preprocess_images(images: list[torch.Tensor], geom: ImageGeometry | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Images of one request -> pixel_values (sum of patches, 3*P*P) fp32, image_grid_hw (n_grids, 2) int64
    and the number of grids of each image: one per image (dynamic), its tiles with the thumbnail last (tiled).
    The tower takes each grid as an image of its own; the grids of an image are consecutive."""
    geom = geom or ImageGeometry()
    if geom.scheme == TILED:
        from nemotron.vision_tiles import preprocess_tiled
        return preprocess_tiled(images, geom)
    if geom.scheme != DYNAMIC:
        raise ValueError(f"unknown image scheme {geom.scheme!r}")
    budget = patch_budget(geom, len(images))
    out = [preprocess_one(im, geom, budget) for im in images]
    pixel_values = torch.cat([p for p, _ in out]) if out else torch.zeros(0, 3 * geom.patch_size ** 2)
    grid_hw = torch.tensor([g for _, g in out], dtype=torch.int64).reshape(-1, 2)
    return pixel_values, grid_hw, [1] * len(out)


def preprocess(images: list[torch.Tensor], geom: ImageGeometry | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Images of one request -> pixel_values (sum of patches, 3*P*P) fp32 and image_grid_hw (n_grids, 2) int64
    (one grid per image in the dynamic scheme; see `preprocess_images` for the grids of each image)."""
    pixel_values, grid_hw, _ = preprocess_images(images, geom)
    return pixel_values, grid_hw


def image_token_count(grid_hw, geom: ImageGeometry | None = None) -> int:
    """`<image>` tokens one image of grid (gh, gw) takes (the projector's output rows)."""
    geom = geom or ImageGeometry()
    gh, gw = (int(v) for v in grid_hw)
    return gh * gw // geom.merge_size ** 2


def image_placeholder(grid_hw, geom: ImageGeometry | None = None) -> str:
    """What one `<image>` of the rendered chat template becomes (an image of one grid)."""
    return placeholder_for(image_token_count(grid_hw, geom))


def placeholder_for(n_tokens: int) -> str:
    """`<img>` + `<image>` x n + `</img>`: one image of n tokens, whatever its number of grids (tiles)."""
    return IMAGE_START + IMAGE_TOKEN * n_tokens + IMAGE_END


def tokens_per_image(grid_hw, grids_per_image=None, geom: ImageGeometry | None = None) -> list[int]:
    """`<image>` tokens of each image: the sum over its grids (consecutive in `grid_hw`); without
    `grids_per_image`, one grid per image."""
    grids = [tuple(int(v) for v in g) for g in torch.as_tensor(grid_hw).reshape(-1, 2).tolist()]
    if grids_per_image is None:
        grids_per_image = [1] * len(grids)
    grids_per_image = [int(n) for n in grids_per_image]
    if sum(grids_per_image) != len(grids) or any(n < 1 for n in grids_per_image):
        raise ValueError(f"{len(grids)} grids cannot be split into images of {grids_per_image} grids")
    out, o = [], 0
    for n in grids_per_image:
        out.append(sum(image_token_count(g, geom) for g in grids[o:o + n]))
        o += n
    return out
