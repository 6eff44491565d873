"""The vision tower and projector against transformers 5.24's NemotronH Omni on tiny random weights, fp32.

transformers builds the model, `save_pretrained` writes it in the published layout (fused qkv,
`vision_model.radio_model.model.…`, `mlp1.…`), and our code reads those tensors through
`nemotron.checkpoint.Checkpoint`.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from nemotron import vision
from nemotron.checkpoint import Checkpoint

ATOL = 2e-5      # fp32; observed max |diff| is ~1e-6 against outputs of magnitude ~1
# (gh, gw) per image; 20 > the 16-position table side exercises the upsampled table, 16x16 the unchanged one
GRIDS_ONE = [(4, 6)]
GRIDS_PACKED = [(6, 4), (2, 2), (20, 8), (16, 16)]


def tiny_omni(tmp_path, mtp: bool):
    from transformers import NemotronH_Omni_Reasoning_V3, NemotronH_Omni_Reasoning_V3_Config

    torch.manual_seed(0)
    vc = dict(model_type="radio", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2.0,
              patch_size=16, max_img_size=256, num_cls_tokens=3, num_registers=7, video_temporal_patch_size=2)
    tc = dict(model_type="nemotron_h", vocab_size=300, hidden_size=48, num_hidden_layers=2,
              layers_block_type=["mamba", "attention"], num_attention_heads=4, num_key_value_heads=2, head_dim=12,
              mamba_num_heads=4, mamba_head_dim=12, ssm_state_size=8, n_groups=1, intermediate_size=96,
              num_nextn_predict_layers=1 if mtp else 0)
    cfg = NemotronH_Omni_Reasoning_V3_Config(vision_config=vc, text_config=tc, projector_hidden_size=96,
                                             vision_hidden_size=64, image_token_id=18)
    cfg._attn_implementation = "eager"
    cfg.vision_config._attn_implementation = "eager"
    model = NemotronH_Omni_Reasoning_V3(cfg).eval()
    assert (model.vision_final_layernorm is not None) == mtp
    # the default init (std 0.02) makes blocks near-identity; O(1) weights give every term a say in the output
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("language_model") or "layer_scale" in name:
                continue
            if p.ndim == 2 and "token" not in name:
                p.normal_(0, 1 / math.sqrt(p.shape[1]))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.5 if "position" in name else 0.2)
    out = tmp_path / ("omni_mtp" if mtp else "omni")
    model.save_pretrained(out)
    omni_config = json.loads((out / "config.json").read_text())
    # Checkpoint parses config.json as the language model's; until it reads Omni configs itself, give it the
    # text config there (the tensors, which is what this test reads, are the published layout as saved)
    (out / "config.json").write_text(json.dumps(omni_config["text_config"]))
    return model, Checkpoint(out), omni_config


@pytest.fixture(scope="module", params=[False, True], ids=["nano_omni", "with_final_norm"])
def setup(request, tmp_path_factory):
    return tiny_omni(tmp_path_factory.mktemp("vision"), mtp=request.param)


def inputs(grids, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(a * b for a, b in grids)
    return torch.randn(n, 768, generator=g), torch.tensor(grids)


def reference(model, pixel_values, grid_hw):
    with torch.no_grad():
        feats = model.vision_model(pixel_values, image_grid_hw=grid_hw).features
        embeds = model.get_image_features(pixel_values, grid_hw).pooler_output
    return feats, embeds


def max_diff(a, b):
    return (a - b).abs().max().item()


def test_published_names_are_what_we_read(setup):
    _, ckpt, _ = setup
    names = set(ckpt.tensor_names())
    assert f"{vision.TOWER}blocks.1.attn.qkv.weight" in names and f"{vision.PROJECTOR}3.weight" in names
    assert not any(".q_proj." in n or "multi_modal_projector" in n for n in names if not n.startswith("language_model"))


@pytest.mark.parametrize("grids", [GRIDS_ONE, GRIDS_PACKED], ids=["one_image", "four_images"])
def test_tower_and_projector_match_transformers(setup, grids):
    model, ckpt, omni_config = setup
    tower = vision.VisionTower.from_checkpoint(ckpt, omni_config)
    assert tower.cfg.has_final_norm == (model.vision_final_layernorm is not None)
    c = tower.cfg
    assert (c.num_layers, c.num_heads, c.num_prefix_tokens, c.table_side) == (2, 4, 10, 16)
    pv, grid = inputs(grids)
    ref_feats, ref_embeds = reference(model, pv, grid)
    feats = tower.features(pv, grid)
    assert max_diff(torch.cat(feats), ref_feats) < ATOL
    embeds = tower(pv, grid)
    assert [tuple(e.shape) for e in embeds] == [(a * b // 4, 48) for a, b in grids]
    for got, want in zip(embeds, ref_embeds):
        assert want.abs().max() > 0.1          # the comparison is about non-trivial numbers
        assert max_diff(got, want) < ATOL * max(1.0, want.abs().max().item())


# ---------------------------------------------------------------- must-fail twins: each bug is caught
def twin_diff(setup, grids=GRIDS_PACKED):
    model, ckpt, omni_config = setup
    pv, grid = inputs(grids)
    _, ref_embeds = reference(model, pv, grid)
    tower = vision.VisionTower.from_checkpoint(ckpt, omni_config)
    return tower, pv, grid, ref_embeds


def worst(got, want):
    return max(max_diff(a, b) for a, b in zip(got, want))


def test_twin_qkv_order_swapped(setup):
    tower, pv, grid, ref = twin_diff(setup)
    assert worst(tower(pv, grid), ref) < ATOL * 10
    h = tower.cfg.hidden_size
    for i in tower.n_blocks_stage:       # read the fused rows as k, q, v
        b = tower.weights.stages[i]
        for k in ("attn.qkv.weight", "attn.qkv.bias"):
            b[k] = torch.cat([b[k][h:2 * h], b[k][:h], b[k][2 * h:]])
    assert worst(tower(pv, grid), ref) > 1e-2


def test_twin_position_table_mode(setup, monkeypatch):
    tower, pv, grid, ref = twin_diff(setup)
    monkeypatch.setattr(vision, "POS_TABLE_MODE", "bicubic")
    assert worst(tower(pv, grid), ref) > 1e-2


def test_twin_position_table_resized_to_grid_not_cropped(setup):
    """Resizing the table straight to (gh, gw), instead of to the longer side and cropping, is caught."""
    tower, pv, grid, ref = twin_diff(setup)
    s = tower.cfg.table_side

    def stretched(table, gh, gw):
        t = table.reshape(1, s, s, -1).permute(0, 3, 1, 2)
        t = torch.nn.functional.interpolate(t, size=(gh, gw), mode="bilinear", align_corners=False)
        return t.flatten(2)[0].transpose(0, 1)
    tower.position_embedding = stretched
    assert worst(tower(pv, grid), ref) > 1e-2


def test_twin_patches_merged_in_wrong_order(setup, monkeypatch):
    tower, pv, grid, ref = twin_diff(setup)
    right = vision.pixel_shuffle

    def column_major(features, gh, gw, m=2):   # the legacy ps_version "v1" order: (b, a) instead of (a, b)
        c = features.shape[-1]
        f = features.view(gh // m, m, gw // m, m, c).permute(0, 2, 3, 1, 4)
        return f.reshape((gh // m) * (gw // m), m * m * c)

    assert torch.equal(right(torch.arange(16.).view(16, 1), 4, 4)[0], torch.tensor([0., 1., 4., 5.]))
    monkeypatch.setattr(vision, "pixel_shuffle", column_major)
    assert worst(tower(pv, grid), ref) > 1e-2


def test_twin_prefix_tokens_given_positions(setup, monkeypatch):
    """Position embedding on the prefix tokens too (a plausible mistake) is caught."""
    tower, pv, grid, ref = twin_diff(setup, GRIDS_ONE)
    orig = tower.embed

    def embed(w, patches, gh, gw):
        h = orig(w, patches, gh, gw)
        return h + torch.cat([tower.position_embedding(w["pos_table"], gh, gw)[: tower.cfg.num_prefix_tokens],
                              torch.zeros_like(h[tower.cfg.num_prefix_tokens:])])
    tower.embed = embed
    assert worst(tower(pv, grid), ref) > 1e-2


def test_bad_inputs(setup):
    _, ckpt, omni_config = setup
    tower = vision.VisionTower.from_checkpoint(ckpt, omni_config)
    pv, grid = inputs(GRIDS_ONE)
    with pytest.raises(vision.VisionError, match="patches"):
        tower(pv[:-1], grid)
    with pytest.raises(vision.VisionError, match="merge size"):
        tower(torch.randn(15, 768), torch.tensor([[3, 5]]))
    bad = dict(omni_config, vision_config={k: v for k, v in omni_config["vision_config"].items()
                                           if k != "num_attention_heads"})
    with pytest.raises(vision.VisionError, match="num_attention_heads"):
        vision.VisionConfig.from_checkpoint(ckpt, bad)
    released = dict(omni_config, vision_config={"args": {"model": "vit_huge_patch16_224"}, "patch_size": 16})
    assert vision.VisionConfig.from_checkpoint(ckpt, released).num_heads == 16
