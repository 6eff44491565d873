"""The `omni` synthetic checkpoint (tools/synth_vision.py): transformers 5.24 loads it as NemotronH Omni with
nothing missing, our preprocessing + tower + projector reproduce its image embeddings end to end, and its
tokenizer and chat template carry the image tokens."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from nemotron import vision
from nemotron import vision_preprocess as vp
from tools.synth_tokenizer import CHAT_TEMPLATE
from tools.synth_vision import IMAGE_START_ID, IMAGE_TOKEN_ID, synthesize_omni


class IndexedTensors:
    """get/has over a safetensors index: an independent reader, so this test does not lean on `Checkpoint`."""

    def __init__(self, d):
        self.d = d
        self.shard_of = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]

    def has(self, name):
        return name in self.shard_of

    def get(self, name):
        with safe_open(self.d / self.shard_of[name], framework="pt") as f:
            return f.get_tensor(name)


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    d = tmp_path_factory.mktemp("omni")
    cfg = synthesize_omni(d, seed=3)
    return d, cfg


@pytest.fixture(scope="module")
def hf(omni):
    from transformers import NemotronH_Omni_Reasoning_V3
    d, _ = omni
    model, info = NemotronH_Omni_Reasoning_V3.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


def png(w, h, seed):
    arr = np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def test_transformers_loads_the_published_layout(omni, hf):
    d, cfg = omni
    model, info = hf
    assert not info["missing_keys"] and not info["mismatched_keys"]
    # as with the release: the input conditioner's statistics are in the file, and transformers drops them
    assert set(info["unexpected_keys"]) <= {"vision_model.input_conditioner.norm_mean",
                                            "vision_model.input_conditioner.norm_std"}
    assert model.config.image_token_id == IMAGE_TOKEN_ID
    assert model.config.text_config.hidden_size == cfg["llm_config"]["hidden_size"]
    assert model.config.vision_hidden_size == 64 and model.vision_final_layernorm is None
    names = IndexedTensors(d).shard_of
    assert all(n.startswith(("language_model.backbone.", "language_model.lm_head.", "vision_model.radio_model.",
                             "mlp1.")) for n in names)


def test_end_to_end_image_embeddings_match_transformers(omni, hf):
    d, cfg = omni
    model, _ = hf
    geom = vp.ImageGeometry.from_dict(json.loads((d / "preprocessor_config.json").read_text()))
    assert (geom.min_num_patches, geom.max_num_patches) == (64, 256)
    images = [vp.decode_image(png(w, h, s)) for s, (w, h) in enumerate([(300, 200), (45, 130)])]
    pv, grid = vp.preprocess(images, geom)
    tower = vision.VisionTower.from_checkpoint(IndexedTensors(d), cfg)
    got = tower(pv, grid)
    with torch.no_grad():
        want = model.get_image_features(pv, grid).pooler_output
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        assert g.shape == w.shape == (w.shape[0], cfg["llm_config"]["hidden_size"])
        assert w.abs().max() > 0.1
        assert (g - w).abs().max() < 2e-5 * max(1.0, w.abs().max().item())


def test_tokenizer_and_chat_template_carry_image_tokens(omni):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer
    d, cfg = omni
    end_id = cfg["image_end_token_id"]
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    ids = tok.encode(vp.image_placeholder((4, 6)), add_special_tokens=False).ids
    assert ids == [IMAGE_START_ID] + [IMAGE_TOKEN_ID] * 6 + [end_id]
    hf_tok = AutoTokenizer.from_pretrained(d)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in it?"},
                                         {"type": "image_url", "image_url": {"url": "data:,"}}]}]
    text = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\n<image>What is in it?<image><|im_end|>" in text
    # string content renders exactly as the text model's template does
    import jinja2
    plain = [{"role": "user", "content": "hi"}]
    ref = jinja2.Environment().from_string(CHAT_TEMPLATE).render(messages=plain, add_generation_prompt=True)
    assert hf_tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True) == ref
