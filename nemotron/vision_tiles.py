"""Static tiled image scheme (Nemotron Nano 12B v2 VL; the fallback when the vision config has no
`min_num_patches`): InternVL's `dynamic_preprocess` as the checkpoint's own `NemotronNanoVLV2ImageProcessor` runs it.

- Grid: among the (columns, rows) with 1 <= columns*rows <= max_num_tiles, the one whose columns/rows is closest to
  the image's width/height. Candidates are visited by increasing tile count; on an exactly equal distance the later
  (larger) grid wins only while the image's area exceeds half of that grid's canvas (InternVL's tie rule).
- Resize the whole image to (rows*S, columns*S) (S = image_size, 512 released) and cut S x S tiles row-major
  (left to right, then top to bottom); when there is more than one tile and `use_thumbnail`, the whole image
  resized to S x S is appended last.
- Resize: the checkpoint's processor converts to float (`ToTensor`, x/255 in float32) and then resizes with
  torchvision's bicubic on the float tensor, which is `F.interpolate(mode="bicubic", align_corners=False,
  antialias=True)` without clamping; normalization is `(x - mean) / std` with fp32 mean and std (not the fused
  form of the dynamic scheme).
- Each tile is then an image of its own for the tower: grid (S/P, S/P) in `image_grid_hw`, (S/P)^2 / merge^2
  tokens (256 released); an image is wrapped once as `<img>` + `<image>` x (tiles * 256) + `</img>`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_TILE_SIZE = 512
DEFAULT_MAX_NUM_TILES = 12


def candidate_grids(max_num_tiles: int, min_num_tiles: int = 1) -> list[tuple[int, int]]:
    """(columns, rows) with min <= columns*rows <= max, by increasing columns*rows.

    Within one tile count the order never decides the result: two grids with the same count and different
    shapes are never both the closest (a grid in between, e.g. 1x1, 1x2 or 2x1, is always closer), which the
    tests check exhaustively. Columns-major within a count, like transformers' `get_all_supported_aspect_ratios`.
    """
    if max_num_tiles < 1 or min_num_tiles < 1:
        raise ValueError(f"tile counts must be >= 1, got min {min_num_tiles}, max {max_num_tiles}")
    grids = [(c, r) for c in range(1, max_num_tiles + 1) for r in range(1, max_num_tiles + 1)
             if min_num_tiles <= c * r <= max_num_tiles]
    return sorted(grids, key=lambda g: g[0] * g[1])


def closest_grid(width: int, height: int, tile_size: int = DEFAULT_TILE_SIZE,
                 max_num_tiles: int = DEFAULT_MAX_NUM_TILES, min_num_tiles: int = 1) -> tuple[int, int]:
    """(columns, rows) of the tile grid for an image of width x height px (InternVL's closest aspect ratio)."""
    if width < 1 or height < 1:
        raise ValueError(f"image of {width}x{height} px is empty")
    aspect = width / height
    area = width * height
    best, best_diff = (1, 1), float("inf")
    for cols, rows in candidate_grids(max_num_tiles, min_num_tiles):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and area > 0.5 * tile_size * tile_size * cols * rows:
            best = (cols, rows)
    return best


def num_tiles(width: int, height: int, tile_size: int = DEFAULT_TILE_SIZE,
              max_num_tiles: int = DEFAULT_MAX_NUM_TILES, use_thumbnail: bool = True) -> int:
    """Tiles one image becomes, thumbnail included."""
    cols, rows = closest_grid(width, height, tile_size, max_num_tiles)
    n = cols * rows
    return n + 1 if use_thumbnail and n > 1 else n


def _resize(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(1, C, H, W) float32 -> (1, C, height, width): torchvision's bicubic on float tensors."""
    if tuple(x.shape[-2:]) == (height, width):
        return x
    return F.interpolate(x, size=(height, width), mode="bicubic", align_corners=False, antialias=True)


def dynamic_preprocess(image: torch.Tensor, tile_size: int = DEFAULT_TILE_SIZE,
                       max_num_tiles: int = DEFAULT_MAX_NUM_TILES, use_thumbnail: bool = True) -> torch.Tensor:
    """uint8 (3, H, W) -> float32 (n, 3, S, S) in [0, 1] (plus the bicubic overshoot): the tiles row-major, then
    the thumbnail. Not normalized."""
    if image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"expected a (3, H, W) RGB image, got shape {tuple(image.shape)}")
    _, height, width = image.shape
    cols, rows = closest_grid(width, height, tile_size, max_num_tiles)
    x = (image.to(torch.float32) / 255).unsqueeze(0)              # ToTensor: float32, then / 255
    canvas = _resize(x, rows * tile_size, cols * tile_size)[0]
    s = tile_size
    # (3, rows*S, cols*S) -> (rows, cols, 3, S, S): tile k is row k // cols, column k % cols
    tiles = canvas.reshape(3, rows, s, cols, s).permute(1, 3, 0, 2, 4).reshape(rows * cols, 3, s, s)
    if use_thumbnail and rows * cols > 1:
        tiles = torch.cat([tiles, _resize(x, s, s)])
    return tiles


def normalize(tiles: torch.Tensor, mean, std) -> torch.Tensor:
    """(x - mean) / std with mean and std as fp32 tensors (the checkpoint processor's form)."""
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    d = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return (tiles - m) / d


def tiles_to_patches(tiles: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(n, C, S, S) -> (n * (S/P)^2, C*P*P): per tile row-major over its patch grid, each patch channel-major
    (the layout `vision_preprocess.image_to_patches` gives one image)."""
    n, c, h, w = tiles.shape
    gh, gw = h // patch_size, w // patch_size
    p = tiles.reshape(n, c, gh, patch_size, gw, patch_size).permute(0, 2, 4, 1, 3, 5)
    return p.reshape(n * gh * gw, c * patch_size * patch_size)


def preprocess_tiled(images: list[torch.Tensor], geom) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Images of one request -> pixel_values (sum of patches, 3*P*P) fp32, image_grid_hw (total tiles, 2) with
    one (S/P, S/P) row per tile in image order, and the tile count of each image."""
    s, ps = geom.image_size, geom.patch_size
    if s % ps or (s // ps) % geom.merge_size:
        raise ValueError(f"tile size {s} is not a multiple of patch {ps} x merge {geom.merge_size}")
    rows, counts = [], []
    for im in images:
        t = normalize(dynamic_preprocess(im, s, geom.max_num_tiles, geom.use_thumbnail), geom.image_mean,
                      geom.image_std)
        rows.append(tiles_to_patches(t, ps))
        counts.append(t.shape[0])
    pixel_values = torch.cat(rows) if rows else torch.zeros(0, 3 * ps * ps)
    grid_hw = torch.tensor([[s // ps, s // ps]] * sum(counts), dtype=torch.int64).reshape(-1, 2)
    return pixel_values, grid_hw, counts
