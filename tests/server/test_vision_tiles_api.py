"""Images in `/v1/chat/completions` on a launcher serving the tiny *tiled* checkpoint (`synthesize_omni(tiled=True)`,
Nano 12B v2 VL layout, CPU fp32): the launcher picks the tiled scheme from the checkpoint's preprocessor config,
sends one grid row (and digest) per tile, wraps each image once in `<img>...</img>`, and the compute process's
answer equals the engine's own image path (`build_image_prompt` + tower + `forward`). Twins: the tiles of an
image column-major, and the images exchanged, give other log-probabilities."""
from __future__ import annotations

import pytest
import torch

from tests.server.test_vision_api import (_launch, answer, cached, data_url, encode, far, img, ok, same,
                                          text_view, user)
from tools.synth_vision import IMAGE_START_ID, IMAGE_TOKEN_ID, synthesize_omni

# 300x200: 3x2 tiles + thumbnail (7 x 16 tokens); 40x130: 1x3 + thumbnail (4 x 16)
A, B = data_url(encode(300, 200, 1)), data_url(encode(40, 130, 2))


@pytest.fixture(scope="module")
def tiled(tmp_path_factory):
    from expert_store.writer import repack
    tmp = tmp_path_factory.mktemp("vision-tiles-api")
    d = tmp / "omni-tiled"
    synthesize_omni(d, seed=13, tiled=True)
    repack(text_view(d, tmp / "text"), tmp / "store", progress=False)
    return d, tmp / "store"


@pytest.fixture(scope="module")
def server(tiled, tmp_path_factory):
    s = _launch(tmp_path_factory, "srv-tiles", tiled[0], "--store", str(tiled[1]))
    yield s
    s.stop()


def test_two_tiled_images_match_the_engine_reference(server, tiled):
    from nemotron.checkpoint import Checkpoint
    from nemotron.model import NemotronH
    from nemotron.vision import VisionTower
    from nemotron.vision_prompt import build_image_prompt
    from tools.logits import logits_and_greedy
    messages = [user("Compare", img(A), "with", img(B), "please.")]
    got = ok(server, messages, max_tokens=4)
    ids = got["choices"][0]["prompt_token_ids"]
    assert ids.count(IMAGE_TOKEN_ID) == (7 + 4) * 16 and ids.count(IMAGE_START_ID) == 2
    ck = Checkpoint(tiled[0])
    # the prompt (thinking off) is the server's ids; the pixels and their order come from build_image_prompt
    p = build_image_prompt(tiled[0], messages, ck.config.multimodal)
    assert p.grids_per_image == [7, 4]
    with torch.inference_mode():
        emb = torch.cat(VisionTower.from_checkpoint(ck, ck.config.multimodal)(p.pixel_values, p.grid_hw))
    pos = torch.tensor([i for i, t in enumerate(ids) if t == IMAGE_TOKEN_ID])
    assert torch.equal(pos - pos[0], p.image_positions - p.image_positions[0])
    model = NemotronH(tiled[0])
    toks, lps = answer(got)
    _, greedy, gl = logits_and_greedy(model, ids, 4, 0, emb, pos)
    assert toks == greedy.tolist()[:len(toks)]
    first = logits_and_greedy(model, ids, 0, 0, emb, pos)[0][-1]
    assert abs(float(torch.log_softmax(torch.tensor(first), -1)[toks[0]]) - lps[0]) < 1e-3
    ref_lp = torch.log_softmax(torch.tensor(gl), -1)     # row k: the logits token k was chosen from
    for k in range(len(toks)):
        assert abs(lps[k] - float(ref_lp[k, toks[k]])) < 1e-3
    # must-fail twin: image A's 3x2 tiles in column-major order
    t = emb[:7 * 16].reshape(7, 16, -1)
    colmajor = torch.cat([t[:6].reshape(2, 3, 16, -1).transpose(0, 1).reshape(6 * 16, -1), t[6].reshape(16, -1),
                          emb[7 * 16:]])
    twin = logits_and_greedy(model, ids, 0, 0, colmajor, pos)[0][-1]
    assert abs(float(torch.log_softmax(torch.tensor(twin), -1)[toks[0]]) - lps[0]) > 1e-3


def test_tiled_image_order_and_snapshots(server):
    a = ok(server, [user("Look:", img(A), img(A))], cache_prompt=False)
    b = ok(server, [user("Look:", img(B), img(A))], cache_prompt=False)
    assert far(a, b)
    text = "Snapshot probe: what is in the picture?"
    first = ok(server, [user(text, img(A))])
    ids = first["choices"][0]["prompt_token_ids"]
    other = ok(server, [user(text, img(data_url(encode(300, 200, 3))))])      # same tiling, other pixels
    assert other["choices"][0]["prompt_token_ids"] == ids
    assert cached(other) <= ids.index(IMAGE_TOKEN_ID), "a snapshot of one image served another"
    again = ok(server, [user(text, img(A))])
    last_image = len(ids) - 1 - ids[::-1].index(IMAGE_TOKEN_ID)
    assert cached(again) > last_image and same(again, first)
