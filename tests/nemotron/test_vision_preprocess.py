"""Image preprocessing against transformers 5.24's NemotronH Omni image processor.

Pixel values: golden summaries (exact sums and 4096 sampled values per case) written by
`make_vision_goldens.py` from the real processor (it needs torchvision, which cannot live in this
environment; see that file). Grids and token counts: live, against `get_patch_grid_size` taken from the
installed transformers source (that function is pure Python; its module imports torchvision at the top).
"""
from __future__ import annotations

import ast
import inspect
import io
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from nemotron import vision_preprocess as vp

GOLDEN = Path(__file__).parent / "data" / "vision_preprocess_golden.safetensors"   # (*.npz is git-ignored)
N_SAMPLES = 4096
SMALL = dict(min_num_patches=64, max_num_patches=256)
# name -> (image sizes (W, H), PIL mode, processor kwargs)
GOLDEN_CASES = {
    "tiny": ([(5, 7)], "RGB", SMALL),
    "odd": ([(37, 53)], "RGB", SMALL),
    "wide": ([(300, 41)], "RGB", SMALL),
    "tall": ([(41, 300)], "RGB", SMALL),
    "huge_clamped": ([(2000, 1500)], "RGB", SMALL),
    "exact_no_resize": ([(128, 128)], "RGB", SMALL),
    "rgba": ([(90, 60)], "RGBA", SMALL),
    "gray": ([(70, 50)], "L", SMALL),
    "three_in_one_call": ([(200, 100), (33, 190), (64, 64)], "RGB", dict(SMALL, max_model_len=40)),
    "patch8_other_stats": ([(123, 77)], "RGB", dict(patch_size=8, min_num_patches=64, max_num_patches=400,
                                                      image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.25, 0.3])),
    "defaults_1920x1080": ([(1920, 1080)], "RGB", {}),
}


def make_image(w: int, h: int, mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(1000 + seed * 7 + w * 13 + h)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, size=(h, w, channels), dtype=np.uint8)
    # a smooth ramp under the noise so the resize sees both edges and gradients
    ramp = (np.linspace(0, 120, w)[None, :, None] + np.linspace(0, 100, h)[:, None, None]).astype(np.uint8)
    arr = (arr // 2 + ramp).astype(np.uint8)
    return Image.fromarray(arr[..., 0] if mode == "L" else arr, mode)


def summarize(pv: torch.Tensor) -> dict:
    flat = pv.reshape(-1).double()
    idx = np.random.default_rng(flat.numel()).choice(flat.numel(), size=min(N_SAMPLES, flat.numel()), replace=False)
    return {
        "shape": np.array(pv.shape),
        "sum": flat.sum().numpy(), "abs_sum": flat.abs().sum().numpy(), "sq_sum": (flat * flat).sum().numpy(),
        "idx": idx, "samples": pv.reshape(-1)[torch.from_numpy(idx)].numpy(),
    }


def png_bytes(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def ours(name):
    sizes, mode, kwargs = GOLDEN_CASES[name]
    geom = vp.ImageGeometry.from_dict(kwargs)
    images = [vp.decode_image(png_bytes(make_image(w, h, mode, seed=i))) for i, (w, h) in enumerate(sizes)]
    return vp.preprocess(images, geom)


@pytest.fixture(scope="module")
def golden():
    return {k: v.numpy() for k, v in load_file(GOLDEN).items()}


@pytest.mark.parametrize("name", list(GOLDEN_CASES))
def test_pixel_values_match_transformers(name, golden):
    pv, grid = ours(name)
    assert pv.dtype == torch.float32
    np.testing.assert_array_equal(grid.numpy(), golden[f"{name}/grid"], err_msg=f"{name}: patch grid")
    ref = {k.split("/", 1)[1]: v for k, v in golden.items() if k.startswith(name + "/")}
    assert tuple(pv.shape) == tuple(ref["shape"]), name
    got = summarize(pv)
    np.testing.assert_array_equal(got["idx"], ref["idx"])
    # observed: bit-identical; 1e-5 leaves room for another CPU's vectorization of the resize
    np.testing.assert_allclose(got["samples"], ref["samples"], rtol=0, atol=1e-5, err_msg=f"{name}: sampled pixels")
    n = pv.numel()
    for k in ("sum", "abs_sum", "sq_sum"):
        assert abs(got[k].item() - ref[k].item()) <= 1e-6 * n + 1e-6 * abs(ref[k].item()), (name, k)


def resized_twin(name, **interp):
    """Our pipeline with the resize swapped for another filter: the must-fail twin of the pixel check."""
    sizes, mode, kwargs = GOLDEN_CASES[name]
    geom = vp.ImageGeometry.from_dict(kwargs)
    img = vp.decode_image(png_bytes(make_image(*sizes[0], mode, seed=0)))
    gh, gw = vp.patch_grid(img.shape[1], img.shape[2], 16, 2, geom.min_num_patches, geom.max_num_patches)
    x = torch.nn.functional.interpolate(img.float()[None], size=(gh * 16, gw * 16), align_corners=False, **interp)[0]
    mean = torch.tensor(geom.image_mean).view(-1, 1, 1) * 255
    std = torch.tensor(geom.image_std).view(-1, 1, 1) * 255
    return vp.image_to_patches((x - mean) / std, 16)


@pytest.mark.parametrize("name,interp", [
    ("odd", dict(mode="bilinear", antialias=True)),
    ("huge_clamped", dict(mode="bicubic", antialias=False)),
])
def test_pixel_check_catches_wrong_filter(name, interp, golden):
    assert np.abs(summarize(resized_twin(name, **interp))["samples"] - golden[f"{name}/samples"]).max() > 1e-2
    same = resized_twin(name, mode="bicubic", antialias=True)      # the twin's scaffolding itself is right
    assert np.abs(summarize(same)["samples"] - golden[f"{name}/samples"]).max() < 1e-5


def test_pixel_check_catches_transposed_patches(golden):
    pv, grid = ours("odd")
    gh, gw = grid[0].tolist()
    image = pv.reshape(gh, gw, 3, 16, 16).permute(2, 0, 3, 1, 4).reshape(3, gh * 16, gw * 16)
    assert torch.equal(vp.image_to_patches(image, 16), pv)
    transposed = vp.image_to_patches(image.transpose(1, 2).reshape(3, gh * 16, gw * 16), 16)
    assert np.abs(summarize(transposed)["samples"] - golden["odd/samples"]).max() > 1e-2


def transformers_get_patch_grid_size():
    import transformers.models.nemotron_h_omni as pkg
    src = (Path(inspect.getfile(pkg)).parent / "image_processing_nemotron_h_omni.py").read_text()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "get_patch_grid_size")
    ns = {"math": math}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "get_patch_grid_size", "exec"), ns)
    return ns["get_patch_grid_size"]


def test_grid_matches_transformers_over_many_sizes():
    ref = transformers_get_patch_grid_size()
    rng = np.random.default_rng(0)
    sizes = [(1, 1), (16, 16), (17, 15), (1, 5000), (5000, 1), (8000, 8000), (1664, 2048), (2048, 1664)]
    sizes += [tuple(int(v) for v in rng.integers(1, 6000, 2)) for _ in range(400)]
    sizes += [tuple(int(v) for v in rng.integers(1, 300, 2)) for _ in range(200)]
    n_refused = 0
    for (h, w) in sizes:
        for (ps, m, lo, hi) in [(16, 2, 1024, 13312), (16, 2, 1024, 4096), (16, 2, 64, 256), (8, 2, 64, 400),
                                (16, 2, 1024, 1024), (16, 2, 1024, 0)]:
            try:
                want = ref(h, w, ps, m, lo, hi)
            except ZeroDivisionError:
                want = None
            if want is None or 0 in want:     # transformers fails (or yields an empty grid): we refuse clearly
                with pytest.raises(ValueError, match="too elongated"):
                    vp.patch_grid(h, w, ps, m, lo, hi)
                n_refused += 1
            else:
                assert vp.patch_grid(h, w, ps, m, lo, hi) == want, (h, w, ps, m, lo, hi)
    assert 0 < n_refused < 3 * len(sizes)   # most of the 6 x len(sizes) cases are compared, not refused


@pytest.mark.parametrize("w,h,grid,tokens", [
    (224, 224, (32, 32), 256), (512, 512, (32, 32), 256), (1024, 1024, (64, 64), 1024),
    (4000, 3000, (100, 132), 3300), (3840, 2160, (86, 154), 3311), (1920, 1200, (76, 120), 2280),
    (1856, 1216, (76, 116), 2204),
])
def test_token_counts_at_release_defaults(w, h, grid, tokens):
    g = vp.ImageGeometry()
    got = vp.patch_grid(h, w, 16, 2, g.min_num_patches, vp.patch_budget(g, 1))
    assert got == grid
    assert vp.image_token_count(got, g) == tokens
    s = vp.image_placeholder(got, g)
    assert s.startswith("<img>") and s.endswith("</img>") and s.count("<image>") == tokens


def test_budget_shared_by_images_of_one_call():
    g = vp.ImageGeometry(max_model_len=4096)
    assert vp.patch_budget(g, 1) == 13312                  # (4096-4)*4 = 16368, capped
    g = vp.ImageGeometry(max_model_len=1000)
    assert vp.patch_budget(g, 1) == 3984 and vp.patch_budget(g, 5) == 5120
    assert vp.patch_budget(vp.ImageGeometry(max_model_len=10, max_num_patches=0), 1) == 1024


def test_released_stat_names_and_bad_input():
    g = vp.ImageGeometry.from_dict({"norm_mean": [0.1, 0.2, 0.3], "norm_std": [1, 2, 3], "max_num_patches": 2048})
    assert g.image_mean == (0.1, 0.2, 0.3) and g.image_std == (1.0, 2.0, 3.0) and g.max_num_patches == 2048
    with pytest.raises(ValueError, match="RGB"):
        vp.preprocess_one(torch.zeros(4, 8, 8, dtype=torch.uint8), g, 2048)
