"""Images end to end through the language model, against transformers 5.24's `NemotronH_Omni_Reasoning_V3`
(fp32, CPU, Mamba `time_step_limit = (0, inf)` as tools/hf_reference.py) on the synthetic `omni` checkpoint.

Our side is `tools.logits --messages-file` (chat template, image-token expansion, tower, projector, embeddings
placed into the prompt, prefill and greedy decode). transformers gets our `prompt_ids` and `pixel_values`
(its processor imports torchvision, which does not import here; our preprocessing is bit-identical to it by
the goldens of test_vision_preprocess.py) and runs its own tower, projector, `masked_scatter` and LM."""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from nemotron import vision_preprocess as vp
from nemotron.checkpoint import Checkpoint
from nemotron.model import NemotronH
from nemotron.vision_prompt import build_image_prompt
from tests.nemotron.test_model_vs_transformers import KL_MAX, greedy_agreement, mean_kl
from tools import logits as logits_tool
from tools.synth_vision import IMAGE_START_ID, IMAGE_TOKEN_ID, synthesize_omni

N_GREEDY = 12


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    d = tmp_path_factory.mktemp("omni-e2e")
    synthesize_omni(d, seed=5)
    return d


@pytest.fixture(scope="module")
def hf(omni):
    from transformers import NemotronH_Omni_Reasoning_V3
    model = NemotronH_Omni_Reasoning_V3.from_pretrained(omni, dtype=torch.float32).eval()
    for m in model.modules():
        if type(m).__name__ == "NemotronHMamba2Mixer":
            m.time_step_limit = (0.0, float("inf"))
    return model


def png(w, h, seed):
    arr = np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


MESSAGES = {
    "one": [{"role": "system", "content": "You describe pictures."},
            {"role": "user", "content": [{"type": "text", "text": "What is this? "}, image_part(png(300, 200, 0)),
                                         {"type": "text", "text": " Be brief."}]}],
    "two": [{"role": "user", "content": [image_part(png(300, 200, 0)), {"type": "text", "text": "versus"},
                                         image_part(png(45, 130, 1)), {"type": "text", "text": "- which?"}]}],
}


@torch.inference_mode()
def hf_reference(model, ids, pixel_values, grid_hw, n):
    out = model(input_ids=torch.tensor([ids]), pixel_values=pixel_values, image_grid_hw=grid_hw, use_cache=True)
    logits, cache, last = out.logits[0].numpy(), out.cache, out.logits[0, -1]
    greedy, prev = [], []
    for _ in range(n):
        prev.append(last.numpy())
        tok = int(last.argmax())
        greedy.append(tok)
        step = model(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True)
        cache, last = step.cache, step.logits[0, -1]
    return logits, np.array(greedy), np.stack(prev)


def run_tool(omni, tmp_path, messages):
    mf, out = tmp_path / "messages.json", tmp_path / "out.npz"
    mf.write_text(json.dumps(messages))
    assert logits_tool.main(["--model", str(omni), "--messages-file", str(mf), "--out", str(out),
                             "--decode", str(N_GREEDY), "--prefill-chunk", "37"]) == 0
    return dict(np.load(out))


@pytest.mark.parametrize("case", ["one", "two"])
def test_image_prompt_matches_transformers(omni, hf, tmp_path, case):
    messages = MESSAGES[case]
    got = run_tool(omni, tmp_path, messages)
    ids = [int(t) for t in got["prompt_ids"]]
    p = build_image_prompt(omni, messages, Checkpoint(omni).config.multimodal)
    assert ids == p.ids
    # the expansion: per image <img> <image>*(gh*gw/4) </img>, and nothing else changed in the rendered text
    n_images = {"one": 1, "two": 2}[case]
    assert p.grid_hw.shape[0] == n_images
    counts = [vp.image_token_count(g) for g in p.grid_hw.tolist()]
    assert ids.count(IMAGE_TOKEN_ID) == sum(counts) and ids.count(IMAGE_START_ID) == n_images
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(omni)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    collapsed = tok.decode(ids)
    for n in counts:
        collapsed = collapsed.replace(vp.IMAGE_START + vp.IMAGE_TOKEN * n + vp.IMAGE_END, vp.IMAGE_TOKEN, 1)
    assert collapsed == text

    ref_logits, ref_greedy, ref_prev = hf_reference(hf, ids, p.pixel_values, p.grid_hw, N_GREEDY)
    kl = mean_kl(ref_logits, got["logits"])
    agree, excused = greedy_agreement(ref_greedy, ref_prev, got["greedy"])
    top1 = torch.softmax(torch.from_numpy(ref_logits), -1).max(-1).values.mean().item()
    print(f"{case}: {len(ids)} tokens, mean KL {kl:.2e}, greedy {agree}/{N_GREEDY}, top-1 prob {top1:.2f}")
    assert kl < KL_MAX
    assert agree == N_GREEDY or excused, f"greedy differs at token {agree} without a tie in the reference"
    assert top1 > 0.2, "synthetic logits are too flat for this check to have power"


@pytest.mark.parametrize("twin", ["shifted", "swapped"])
def test_misplaced_image_embeddings_fail(omni, hf, twin):
    """Must-fail twins: the embeddings one position late, or the two images' embeddings exchanged."""
    messages = MESSAGES["two"]
    ids, embeds, positions = logits_tool.image_inputs(omni, messages)
    p = build_image_prompt(omni, messages, Checkpoint(omni).config.multimodal)
    ref_logits, ref_greedy, ref_prev = hf_reference(hf, ids, p.pixel_values, p.grid_hw, N_GREEDY)
    if twin == "shifted":
        positions = positions + 1
    else:
        n0 = vp.image_token_count(p.grid_hw[0].tolist())
        assert n0 != embeds.shape[0] - n0, "equal-size images would make the swap a no-op in shape"
        embeds = torch.cat([embeds[n0:], embeds[:n0]])
    engine = NemotronH(omni)
    logits, greedy, _ = logits_tool.logits_and_greedy(engine, ids, N_GREEDY, 0, embeds, positions)
    kl = mean_kl(ref_logits, logits)
    agree, _ = greedy_agreement(ref_greedy, ref_prev, greedy)
    print(f"{twin}: mean KL {kl:.3f}, greedy {agree}/{N_GREEDY}")
    assert kl > 100 * KL_MAX


def test_checkpoint_reads_omni_layouts(omni, hf, tmp_path):
    """Released layout (`llm_config`) and transformers' `save_pretrained` (`text_config`): the language model's
    tensors are served by their text names, the vision tensors keep theirs, and both give the same logits."""
    ck = Checkpoint(omni)
    assert ck.config.multimodal["model_type"] == "nemotron_h_omni"
    names = set(ck.tensor_names())
    assert "backbone.embeddings.weight" in names and "lm_head.weight" in names
    assert not any(n.startswith("language_model.") for n in names)
    assert "mlp1.1.weight" in names and "vision_model.radio_model.model.patch_generator.pos_embed" in names
    assert ck.stored_name("lm_head.weight") == "language_model.lm_head.weight"
    hf.save_pretrained(tmp_path / "saved")
    saved = Checkpoint(tmp_path / "saved")
    assert "text_config" in json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved.config.layer_types == ck.config.layer_types and saved.config.multimodal is not None
    ids = list(range(20, 60))
    e1, e2 = NemotronH(omni), NemotronH(tmp_path / "saved")
    l1, l2 = e1.forward(ids, e1.new_state()), e2.forward(ids, e2.new_state())
    assert torch.allclose(l1, l2, atol=1e-5, rtol=0)


def test_forward_rejects_bad_image_inputs(omni):
    engine = NemotronH(omni)
    h = engine.config.hidden_size
    with pytest.raises(ValueError, match="together"):
        engine.forward([1, 2, 3], engine.new_state(), image_embeds=torch.zeros(1, h))
    with pytest.raises(ValueError, match="shape"):
        engine.forward([1, 2, 3], engine.new_state(), image_embeds=torch.zeros(2, h), image_positions=[1])
    with pytest.raises(ValueError, match="distinct indices"):
        engine.forward([1, 2, 3], engine.new_state(), image_embeds=torch.zeros(1, h), image_positions=[3])


def test_quant_config_names_with_the_language_model_prefix():
    """An Omni checkpoint's quantization config names modules by their stored (prefixed) names."""
    from nemotron.checkpoint import LANGUAGE_MODEL_PREFIX, QuantConfig
    q = QuantConfig("NVFP4", exclude_modules=["language_model.backbone.layers.0.*", "language_model.lm_head"])
    assert q.expected("backbone.layers.0.mixer.in_proj") == "nvfp4"      # no prefix: a text checkpoint
    q.prefix = LANGUAGE_MODEL_PREFIX
    assert q.expected("backbone.layers.0.mixer.in_proj") == "dense"
    assert q.expected("lm_head") == "dense" and q.expected("backbone.layers.1.mixer.in_proj") == "nvfp4"
    m = QuantConfig("MIXED_PRECISION", quantized_layers={"language_model.backbone.layers.2.mixer.up_proj": "FP8"},
                    prefix=LANGUAGE_MODEL_PREFIX)
    assert m.expected("backbone.layers.2.mixer.up_proj") == "fp8" and m.expected("lm_head") == "dense"


def test_messages_file_needs_an_omni_checkpoint(synth, tmp_path, capsys):
    mf = tmp_path / "m.json"
    mf.write_text(json.dumps(MESSAGES["one"]))
    rc = logits_tool.main(["--model", str(synth("tiny", "bf16")), "--messages-file", str(mf),
                           "--out", str(tmp_path / "o.npz")])
    assert rc == 2 and "Omni / VL checkpoint" in capsys.readouterr().err
