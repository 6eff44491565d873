"""The static tiled image scheme (`nemotron.vision_tiles`; Nemotron Nano 12B v2 VL), checked against:

- tile grids: transformers 5.24's `GotOcr2ImageProcessorPil` (`get_optimal_tiled_canvas`, the PIL/numpy processor,
  imports without torchvision) over ~20k (size, max_num_tiles) cases, tiles with thumbnail through its
  `get_number_of_image_patches`; and a transcription of InternVL's `dynamic_preprocess` grid choice (its candidate
  *set*, whose iteration order differs from transformers' list) written here from the reference's §2.3;
- pixel values: bit-identical to a transcription, written here, of the checkpoint's own processor
  (`NemotronNanoVLV2ImageProcessor`: `ToTensor`, torchvision bicubic on the float tensor, InternVL crop boxes,
  thumbnail, `(x - mean) / std`), and within 1.5/255 of `GotOcr2ImageProcessorPil` (PIL bicubic on uint8) on
  smooth images (PIL rounds and clamps to uint8 after each of its two passes; same a=-0.5 antialiased kernel);
- token counts and prompt expansion; the scheme chosen from config.json / preprocessor_config.json; end to end,
  the tiny tiled checkpoint through `tools.logits --messages-file` against transformers'
  `NemotronH_Omni_Reasoning_V3` fed our per-tile pixel values.
Every check has a must-fail twin that is shown to be caught."""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from nemotron import vision_preprocess as vp
from nemotron import vision_tiles as vt
from nemotron.vision_prompt import build_image_prompt, expand_image_tokens

GEOM = vp.ImageGeometry(scheme=vp.TILED)          # released values: 512 px tiles, 12 tiles, thumbnail


def got_ocr2():
    from transformers.models.got_ocr2 import image_processing_pil_got_ocr2 as m
    return m


# ------------------------------------------------------------------------------------------------ tile grid
def internvl_grid(width, height, image_size, max_num):
    """InternVL `dynamic_preprocess`'s grid (reference §2.3): the candidate set sorted by tile count, the closest
    aspect ratio, ties to the later grid while the image area exceeds half of its canvas."""
    cands = sorted({(i, j) for n in range(1, max_num + 1) for i in range(1, n + 1) for j in range(1, n + 1)
                    if 1 <= i * j <= max_num}, key=lambda r: r[0] * r[1])
    best, best_d = (1, 1), float("inf")
    for i, j in cands:
        d = abs(width / height - i / j)
        if d < best_d:
            best, best_d = (i, j), d
        elif d == best_d and width * height > 0.5 * image_size * image_size * i * j:
            best = (i, j)
    return best


def sizes():
    rng = np.random.default_rng(0)
    out = {(w, h) for w in (1, 2, 3, 7, 16, 100, 255, 256, 257, 511, 512, 513, 700, 1000, 1024, 1536, 2048, 4096)
           for h in (1, 2, 5, 64, 300, 512, 768, 1024, 1500, 3000)}
    out |= {(int(w), int(h)) for w, h in rng.integers(1, 5000, size=(1200, 2))}
    # exact and near ties: multiples of every candidate ratio and of midpoints between neighbours (17:12, 5:4, ...)
    for a, b in [(1, 1), (2, 1), (3, 2), (4, 3), (17, 12), (5, 4), (7, 4), (5, 2), (11, 4), (9, 2), (13, 2), (1, 3)]:
        for k in (64, 128, 256, 300, 512, 700, 1000):
            out |= {(a * k, b * k), (b * k, a * k), (a * k + 1, b * k), (a * k, b * k + 1)}
    return sorted(out)


def test_grid_matches_transformers_got_ocr2_and_internvl():
    import sys
    m = got_ocr2()
    assert "torchvision" not in sys.modules
    n = 0
    for max_num in (1, 2, 3, 4, 6, 9, 12):
        for tile in (512, 448, 128):
            for w, h in sizes():
                ours = vt.closest_grid(w, h, tile, max_num)
                assert ours == m.get_optimal_tiled_canvas((h, w), (tile, tile), 1, max_num), (w, h, tile, max_num)
                assert ours == internvl_grid(w, h, tile, max_num), (w, h, tile, max_num)
                n += 1
    assert n > 20000
    proc = m.GotOcr2ImageProcessorPil(size={"height": 512, "width": 512}, crop_to_patches=True, max_patches=12)
    for w, h in sizes()[::7]:
        assert vt.num_tiles(w, h) == proc.get_number_of_image_patches(h, w), (w, h)
    # what the reference lists for the release: 4x3, 3x4, 2x6, 6x2 layouts at their maximum sizes, 13 tiles each
    for w, h, grid in [(2048, 1536, (4, 3)), (1536, 2048, (3, 4)), (1024, 3072, (2, 6)), (3072, 1024, (6, 2))]:
        assert vt.closest_grid(w, h) == grid and vt.num_tiles(w, h) == 13
    assert vt.closest_grid(1024, 1024) == (2, 2) and vt.closest_grid(700, 700) == (1, 1)     # the tie rule


def test_grid_twins_are_caught():
    """Must-fail twins: no tie rule (keep the first), the ratio taken as rows/columns, ties to the smaller
    canvas whatever the area: each disagrees with transformers somewhere."""
    m = got_ocr2()

    def first_wins(w, h, tile, mx):
        best, bd = (1, 1), float("inf")
        for c, r in vt.candidate_grids(mx):
            if abs(w / h - c / r) < bd:
                best, bd = (c, r), abs(w / h - c / r)
        return best
    twins = {"no tie rule": first_wins,
             "transposed": lambda w, h, tile, mx: vt.closest_grid(h, w, tile, mx),
             "tie on canvas not area": lambda w, h, tile, mx: vt.closest_grid(w, h, tile * 2, mx)}
    for name, twin in twins.items():
        wrong = sum(twin(w, h, 512, 12) != m.get_optimal_tiled_canvas((h, w), (512, 512), 1, 12)
                    for w, h in sizes())
        print(f"{name}: {wrong} sizes differ")
        assert wrong > 0, name


def test_order_within_a_tile_count_never_matters():
    """Why transformers' list order and InternVL's set order agree: two grids with the same tile count are never
    both closest, because at their midpoint another grid is closer by at least 2/3 of the distance (exact
    rationals, every max_num_tiles up to 12)."""
    from fractions import Fraction
    for mx in range(1, 13):
        grids = vt.candidate_grids(mx)
        for a in grids:
            for b in grids:
                if a < b and a[0] * a[1] == b[0] * b[1]:
                    ra, rb = Fraction(*a), Fraction(*b)
                    mid = (ra + rb) / 2
                    closest = min(abs(mid - Fraction(c, r)) for c, r in grids)
                    assert closest <= abs(mid - ra) / 3, (mx, a, b)


# ------------------------------------------------------------------------------------------------ pixels
def checkpoint_processor(image_u8: np.ndarray, size=512, max_num=12, use_thumbnail=True,
                         mean=vp.OPENAI_CLIP_MEAN, std=vp.OPENAI_CLIP_STD, order="rows", thumb="last"):
    """The checkpoint's `NemotronNanoVLV2ImageProcessor` transcribed with plain torch: `ToTensor` (float32, / 255),
    torchvision's tensor `Resize(BICUBIC)` (= F.interpolate bicubic, antialias, no clamp for float), InternVL's
    crop boxes, thumbnail, `(x - mean) / std` with `torch.Tensor` statistics; then per tile the 16 px patches
    row-major, each (C, 16, 16) flattened. `order` / `thumb` give the must-fail twins."""
    h, w = image_u8.shape[:2]
    x = torch.from_numpy(image_u8.copy()).permute(2, 0, 1).contiguous().to(torch.float32).div(255)
    cols, rows = internvl_grid(w, h, size, max_num)

    def resize(t, oh, ow):
        if tuple(t.shape[-2:]) == (oh, ow):
            return t
        return F.interpolate(t[None], size=(oh, ow), mode="bicubic", align_corners=False, antialias=True)[0]
    big = resize(x, rows * size, cols * size)
    boxes = [((i % cols) * size, (i // cols) * size) for i in range(cols * rows)]
    if order == "columns":
        boxes = [((i // rows) * size, (i % rows) * size) for i in range(cols * rows)]
    tiles = [big[:, y0:y0 + size, x0:x0 + size] for x0, y0 in boxes]
    if use_thumbnail and len(tiles) != 1:
        tiles.insert(0 if thumb == "first" else len(tiles), resize(x, size, size))
    pv = (torch.stack(tiles) - torch.Tensor(mean).view(1, 3, 1, 1)) / torch.Tensor(std).view(1, 3, 1, 1)
    patches = [t[:, r * 16:(r + 1) * 16, c * 16:(c + 1) * 16].reshape(-1)
               for t in pv for r in range(size // 16) for c in range(size // 16)]
    return torch.stack(patches), len(tiles)


def noise(w, h, seed):
    return np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)


def smooth(w, h, seed):
    small = np.random.default_rng(seed).integers(0, 256, size=(max(h // 40, 2), max(w // 40, 2), 3), dtype=np.uint8)
    return np.array(Image.fromarray(small).resize((w, h), Image.BILINEAR))


def to_chw(a):
    return torch.from_numpy(a).permute(2, 0, 1).contiguous()


PIXEL_CASES = [(300, 200), (37, 53), (1000, 250), (64, 900), (512, 512), (1024, 1024), (1, 1), (2000, 1500)]


@pytest.mark.parametrize("w,h", PIXEL_CASES)
def test_pixels_bit_identical_to_the_checkpoint_processor(w, h):
    a = noise(w, h, w * 7 + h)
    pv, grid, per = vp.preprocess_images([to_chw(a)], GEOM)
    ref, n = checkpoint_processor(a)
    assert per == [n] and grid.tolist() == [[32, 32]] * n
    assert torch.equal(pv, ref)
    if n > 1:   # must-fail twins: tiles column-major (only differs when both sides have >1 tile), thumbnail first
        if min(vt.closest_grid(w, h)) > 1:
            assert not torch.equal(pv, checkpoint_processor(a, order="columns")[0])
        assert (pv - checkpoint_processor(a, thumb="first")[0]).abs().max() > 0.1


def test_pixels_within_uint8_rounding_of_pil_bicubic():
    """`GotOcr2ImageProcessorPil`: InternVL's original `image.resize` path (PIL bicubic on uint8), same kernel.
    On smooth images (no clamping) the difference is PIL's uint8 rounding after each pass: <= 1.5/255 before
    normalization. Twin: our tiles in column-major order are far off."""
    m = got_ocr2()
    proc = m.GotOcr2ImageProcessorPil(size={"height": 512, "width": 512}, crop_to_patches=True, max_patches=12)
    for w, h in [(300, 200), (900, 1400), (2000, 1500), (513, 512)]:
        a = smooth(w, h, w + h)
        ours = vt.dynamic_preprocess(to_chw(a))
        ref = torch.from_numpy(np.stack(proc(Image.fromarray(a), do_normalize=False)["pixel_values"])).float()
        assert ours.shape == ref.shape
        err = float((ours - ref).abs().max()) * 255
        print(f"{w}x{h}: {ours.shape[0]} tiles, max |ours - PIL| = {err:.2f}/255")
        assert err <= 1.5
        cols, rows = vt.closest_grid(w, h)
        if cols > 1 and rows > 1:
            n = cols * rows
            colmajor = ours[:n].reshape(rows, cols, 3, 512, 512).transpose(0, 1).reshape(n, 3, 512, 512)
            assert float((colmajor - ref[:n]).abs().max()) * 255 > 20


def test_thumbnail_present_and_absent():
    a = noise(1000, 500, 3)
    cols, rows = vt.closest_grid(1000, 500)
    assert (cols, rows) == (2, 1)
    with_t = vt.dynamic_preprocess(to_chw(a), use_thumbnail=True)
    without = vt.dynamic_preprocess(to_chw(a), use_thumbnail=False)
    assert with_t.shape[0] == 3 and without.shape[0] == 2 and torch.equal(with_t[:2], without)
    ref, _ = checkpoint_processor(a, use_thumbnail=False)
    g = vp.ImageGeometry(scheme=vp.TILED, use_thumbnail=False)
    pv, grid, per = vp.preprocess_images([to_chw(a)], g)
    assert per == [2] and torch.equal(pv, ref)
    assert vt.num_tiles(1000, 500) == 3 and vt.num_tiles(1000, 500, use_thumbnail=False) == 2
    # one tile: never a thumbnail
    assert vt.dynamic_preprocess(to_chw(noise(500, 520, 1))).shape[0] == 1
    # twin: a thumbnail on a single tile (always appended) changes the count
    assert vt.num_tiles(500, 520) == 1 != 2


# ------------------------------------------------------------------------------------------------ tokens, prompt
def test_token_counts():
    assert GEOM.tokens_per_tile == 256
    for (w, h), tiles in {(2048, 1536): 13, (512, 512): 1, (1024, 512): 3, (100, 5000): 13, (3000, 2000): 7}.items():
        pv, grid, per = vp.preprocess_images([to_chw(smooth(w, h, 0))], GEOM) if w * h <= 4e6 else (None, None, None)
        assert vt.num_tiles(w, h) == tiles
        if per is not None:
            assert per == [tiles] and vp.tokens_per_image(grid, per, GEOM) == [256 * tiles]
            assert pv.shape == (tiles * 1024, 768)
    assert vt.num_tiles(2048, 1536, use_thumbnail=False) * 256 == 3072
    assert vp.ImageGeometry(scheme=vp.TILED, image_size=128).tokens_per_tile == 16


def test_prompt_expansion_one_and_two_images():
    a, b = to_chw(smooth(1100, 500, 1)), to_chw(smooth(300, 310, 2))
    pv, grid, per = vp.preprocess_images([a, b], GEOM)
    assert per == [3, 1] and grid.shape == (4, 2)      # 2x1 + thumbnail, then one tile
    text = "A<image>B<image>C"
    want = ("A<img>" + "<image>" * 768 + "</img>B<img>" + "<image>" * 256 + "</img>C")
    assert expand_image_tokens(text, grid, GEOM, per) == want
    one = vp.preprocess_images([a], GEOM)
    assert expand_image_tokens("x<image>y", one[1], GEOM, one[2]) == "x<img>" + "<image>" * 768 + "</img>y"
    # twins: one wrapper per tile instead of per image, or the images' counts exchanged
    with pytest.raises(ValueError, match="4 images"):
        expand_image_tokens(text, grid, GEOM)
    assert expand_image_tokens(text, grid, GEOM, [1, 3]) != want
    with pytest.raises(ValueError, match="cannot be split"):
        expand_image_tokens(text, grid, GEOM, [3, 2])


# ------------------------------------------------------------------------------------------------ scheme
def test_scheme_selection(tmp_path):
    omni_cfg = {"vision_config": {"args": {"model": "x", "min_num_patches": 1024, "max_num_patches": 13312}}}
    vl_cfg = {"vision_config": {"args": {"model": "x"}}, "force_image_size": 448, "use_thumbnail": False,
              "norm_mean": [0.5, 0.5, 0.5], "norm_std": [0.5, 0.5, 0.5]}
    tiled_pp = {"image_processor_type": "NemotronNanoVLV2ImageProcessor", "image_size": 512, "max_num_tiles": 6,
                "use_thumbnail": True}
    # config.json decides (vLLM's rule), whatever the preprocessor file says
    assert vp.image_scheme(tiled_pp, omni_cfg) == vp.DYNAMIC
    assert vp.image_scheme({"min_num_patches": 64}, vl_cfg) == vp.TILED
    # without a config (or one without args): the preprocessor file
    assert vp.image_scheme(tiled_pp) == vp.TILED and vp.image_scheme({"max_num_tiles": 12}) == vp.TILED
    assert vp.image_scheme({"min_num_patches": 64}) == vp.DYNAMIC and vp.image_scheme({}) == vp.DYNAMIC
    assert vp.image_scheme(tiled_pp, {"vision_config": {}}) == vp.TILED
    # values: the preprocessor file first, config.json for what it lacks (force_image_size, use_thumbnail, norm)
    g = vp.ImageGeometry.from_dict({"max_num_tiles": 6}, vl_cfg)
    assert (g.scheme, g.image_size, g.max_num_tiles, g.use_thumbnail, g.image_mean) == (
        vp.TILED, 448, 6, False, (0.5, 0.5, 0.5))
    g = vp.ImageGeometry.from_dict(tiled_pp, vl_cfg)
    assert (g.image_size, g.use_thumbnail, g.image_std) == (512, True, (0.5, 0.5, 0.5))
    (tmp_path / "config.json").write_text(json.dumps(vl_cfg))
    assert vp.ImageGeometry.from_model_dir(tmp_path).scheme == vp.TILED
    with pytest.raises(ValueError, match="unknown image scheme"):
        vp.preprocess_images([to_chw(noise(4, 4, 0))], vp.ImageGeometry(scheme="tiles"))


# ------------------------------------------------------------------------------------------------ end to end
def png(w, h, seed):
    buf = io.BytesIO()
    Image.fromarray(smooth(w, h, seed)).save(buf, format="PNG")
    return buf.getvalue()


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


MESSAGES = {
    "one": [{"role": "system", "content": "You describe pictures."},
            {"role": "user", "content": [{"type": "text", "text": "What is this? "}, image_part(png(300, 200, 0)),
                                         {"type": "text", "text": " Be brief."}]}],
    "two": [{"role": "user", "content": [image_part(png(300, 200, 0)), {"type": "text", "text": "versus"},
                                         image_part(png(100, 330, 1)), {"type": "text", "text": "- which?"}]}],
}
N_GREEDY = 12


@pytest.fixture(scope="module")
def tiled(tmp_path_factory):
    from tools.synth_vision import synthesize_omni
    d = tmp_path_factory.mktemp("omni-tiled")
    synthesize_omni(d, seed=7, tiled=True)
    return d


@pytest.fixture(scope="module")
def hf(tiled):
    from transformers import NemotronH_Omni_Reasoning_V3, NemotronH_Omni_Reasoning_V3_Config
    cfg = NemotronH_Omni_Reasoning_V3_Config(**json.loads((tiled / "config.json").read_text()))
    model = NemotronH_Omni_Reasoning_V3.from_pretrained(tiled, config=cfg, dtype=torch.float32).eval()
    for m in model.modules():
        if type(m).__name__ == "NemotronHMamba2Mixer":
            m.time_step_limit = (0.0, float("inf"))
    return model


def test_tiled_checkpoint_selects_tiles(tiled):
    from nemotron.checkpoint import Checkpoint
    g = vp.ImageGeometry.from_model_dir(tiled)
    assert (g.scheme, g.image_size, g.max_num_tiles, g.use_thumbnail, g.tokens_per_tile) == (vp.TILED, 128, 6, True, 16)
    # the preprocessor file alone (what the launcher reads) agrees
    assert vp.ImageGeometry.from_dict(json.loads((tiled / "preprocessor_config.json").read_text())) == g
    mm = Checkpoint(tiled).config.multimodal
    assert "min_num_patches" not in mm["vision_config"]["args"] and vp.image_scheme({}, mm) == vp.TILED


def hf_reference(model, ids, pixel_values, grid_hw, n):
    from tests.nemotron.test_vision_e2e import hf_reference as ref
    return ref(model, ids, pixel_values, grid_hw, n)


def run_tool(model_dir, tmp_path, messages):
    from tests.nemotron.test_vision_e2e import run_tool as run
    return run(model_dir, tmp_path, messages)      # tools.logits --messages-file, N_GREEDY (12) greedy steps


@pytest.mark.parametrize("case", ["one", "two"])
def test_tiled_prompt_matches_transformers(tiled, hf, tmp_path, case):
    from nemotron.checkpoint import Checkpoint
    from tests.nemotron.test_model_vs_transformers import KL_MAX, greedy_agreement, mean_kl
    from tools.synth_vision import IMAGE_START_ID, IMAGE_TOKEN_ID
    messages = MESSAGES[case]
    got = run_tool(tiled, tmp_path, messages)
    ids = [int(t) for t in got["prompt_ids"]]
    p = build_image_prompt(tiled, messages, Checkpoint(tiled).config.multimodal)
    assert ids == p.ids
    want_tiles = {"one": [7], "two": [7, 4]}[case]          # 300x200: 3x2 + thumbnail; 100x330: 1x3 + thumbnail
    assert p.grids_per_image == want_tiles and p.grid_hw.tolist() == [[8, 8]] * sum(want_tiles)
    counts = [16 * t for t in want_tiles]
    assert ids.count(IMAGE_TOKEN_ID) == sum(counts) and ids.count(IMAGE_START_ID) == len(counts)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiled)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    collapsed = tok.decode(ids)
    for n in counts:
        collapsed = collapsed.replace(vp.IMAGE_START + vp.IMAGE_TOKEN * n + vp.IMAGE_END, vp.IMAGE_TOKEN, 1)
    assert collapsed == text

    ref_logits, ref_greedy, ref_prev = hf_reference(hf, ids, p.pixel_values, p.grid_hw, N_GREEDY)
    kl = mean_kl(ref_logits, got["logits"])
    agree, excused = greedy_agreement(ref_greedy, ref_prev, got["greedy"])
    print(f"{case}: {len(ids)} tokens, tiles {want_tiles}, mean KL {kl:.2e}, greedy {agree}/{N_GREEDY}")
    assert kl < KL_MAX
    assert agree == N_GREEDY or excused


@pytest.mark.parametrize("twin", ["tiles column-major", "thumbnail first"])
def test_misordered_tiles_fail(tiled, hf, twin):
    """Must-fail twins at the model: image 0's tile rows (3x2 + thumbnail) column-major, or its thumbnail first,
    against the reference run on the right order."""
    from nemotron.checkpoint import Checkpoint
    from nemotron.model import NemotronH
    from tests.nemotron.test_model_vs_transformers import KL_MAX, mean_kl
    from tools import logits as logits_tool
    messages = MESSAGES["two"]
    ids, embeds, positions = logits_tool.image_inputs(tiled, messages)
    p = build_image_prompt(tiled, messages, Checkpoint(tiled).config.multimodal)
    ref_logits, _, _ = hf_reference(hf, ids, p.pixel_values, p.grid_hw, 1)
    t = embeds[:7 * 16].reshape(7, 16, -1)
    t = torch.cat([t[:6].reshape(2, 3, 16, -1).transpose(0, 1).reshape(6, 16, -1), t[6:]]) \
        if twin == "tiles column-major" else torch.cat([t[6:], t[:6]])
    embeds = torch.cat([t.reshape(7 * 16, -1), embeds[7 * 16:]])
    engine = NemotronH(tiled)
    logits, _, _ = logits_tool.logits_and_greedy(engine, ids, 0, 0, embeds, positions)
    kl = mean_kl(ref_logits, logits)
    print(f"{twin}: mean KL {kl:.3f}")
    assert kl > 100 * KL_MAX
