"""Images in `/v1/chat/completions` on a real launcher serving the synthetic `omni` checkpoint (CPU, fp32): answers
equal the engine's own image path (`tools.logits`), snapshots are bound to the images, and every bad image is a
400 that says why. Three servers: omni (data URLs only, a small pixel limit), omni with `--allow-image-urls`,
and a text-only model."""
from __future__ import annotations

import base64
import http.server
import io
import json
import shutil
import threading

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

from tests.server.harness import Launcher
from tools.synth_vision import IMAGE_TOKEN_ID, synthesize_omni

MAX_LEN = 512
MAX_PIXELS = 20_000
NO_THINK = {"enable_thinking": False}


def text_view(omni, out):
    """The omni checkpoint's language model in the text layout: `tools.repack` reads shard headers by the served
    names, so the expert store is made from this view (same config hash, same tensors)."""
    out.mkdir()
    cfg = json.loads((omni / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg["llm_config"]))
    tensors = {}
    for shard in sorted(omni.glob("model-0*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            tensors |= {k[len("language_model."):]: f.get_tensor(k) for k in f.keys()
                        if k.startswith("language_model.")}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(omni / name, out / name)
    return out


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    from expert_store.writer import repack
    tmp = tmp_path_factory.mktemp("vision-api")
    d = tmp / "omni"
    synthesize_omni(d, seed=11)
    repack(text_view(d, tmp / "omni-text"), tmp / "store", progress=False)
    return d, tmp / "store"


def _launch(tmp_path_factory, name, model, *args, env=None):
    tmp = tmp_path_factory.mktemp(name)
    return Launcher(model, "--max-model-len", str(MAX_LEN), "--cache-gb", "0.0005", "--snapshot-dir",
                    str(tmp / "snaps"), *args, env=env).start(tmp / "launcher.log")


@pytest.fixture(scope="module")
def server(omni, tmp_path_factory):
    s = _launch(tmp_path_factory, "srv", omni[0], "--store", str(omni[1]), "--max-image-pixels", str(MAX_PIXELS))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def url_server(omni, tmp_path_factory):
    s = _launch(tmp_path_factory, "srv-urls", omni[0], "--store", str(omni[1]), "--allow-image-urls",
                "--allow-private-image-urls",     # the test's image server is on 127.0.0.1
                env={"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def text_server(synth, tmp_path_factory):
    s = _launch(tmp_path_factory, "srv-text", synth("tiny", "nvfp4"))
    yield s
    s.stop()


def encode(w, h, seed, fmt="PNG") -> bytes:
    a = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, media="image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def img(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts) -> dict:
    return {"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}


A, B = data_url(encode(40, 30, 1)), data_url(encode(40, 30, 2))


def chat(server, messages, max_tokens=6, **kw):
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "logprobs": True, "top_logprobs": 3,
            "return_token_ids": True, "chat_template_kwargs": NO_THINK, **kw}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


def ok(server, messages, **kw) -> dict:
    r = chat(server, messages, **kw)
    assert r.status_code == 200, r.text
    return r.json()


def answer(resp) -> tuple[list[int], list[float]]:
    c = resp["choices"][0]
    return c["token_ids"], [e["logprob"] for e in c["logprobs"]["content"]]


def same(r1, r2) -> bool:
    """Same tokens and log-probabilities within 1e-4 (chunk boundaries of prefill move the last float bits, as in
    tests/server/test_api.py)."""
    (t1, l1), (t2, l2) = answer(r1), answer(r2)
    return t1 == t2 and l1 == pytest.approx(l2, abs=1e-4)


def far(r1, r2) -> bool:
    """Clearly different answers: other tokens, or a log-probability off by more than 1e-2."""
    (t1, l1), (t2, l2) = answer(r1), answer(r2)
    return t1 != t2 or max(abs(a - b) for a, b in zip(l1, l2)) > 1e-2


def cached(resp) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def bad(server, url_or_parts, status=400) -> str:
    parts = url_or_parts if isinstance(url_or_parts, list) else [img(url_or_parts)]
    r = chat(server, [user("What is this?", *parts)], max_tokens=1)
    assert r.status_code == status, r.text
    return r.json()["error"]["message"]


# ------------------------------------------------------------------------------------------------ answers
def test_two_images_match_the_engine_reference_through_the_openai_client(server, omni):
    messages = [user("Compare", img(A), "with", img(B), "please.")]
    c = server.openai()
    r = c.chat.completions.create(model=c.models.list().data[0].id, messages=messages, max_tokens=4, temperature=0,
                                  extra_body={"chat_template_kwargs": NO_THINK, "return_token_ids": True})
    assert r.choices[0].finish_reason in ("stop", "length")
    ref_msgs = messages
    got = ok(server, ref_msgs, max_tokens=4)
    ids = got["choices"][0]["prompt_token_ids"]
    assert got["usage"]["prompt_tokens"] == len(ids) and r.usage.prompt_tokens == len(ids)
    from nemotron.model import NemotronH
    from nemotron.vision import VisionTower
    from nemotron.checkpoint import Checkpoint
    from nemotron.vision_prompt import build_image_prompt
    ck = Checkpoint(omni[0])
    p = build_image_prompt(omni[0], ref_msgs, ck.config.multimodal)
    assert ids.count(IMAGE_TOKEN_ID) == p.image_positions.numel() > 0
    with torch.inference_mode():
        emb = torch.cat(VisionTower.from_checkpoint(ck, ck.config.multimodal)(p.pixel_values, p.grid_hw))
    from tools.logits import logits_and_greedy
    # the server's prompt (thinking off) with the reference tower output at the server's image positions
    pos = torch.tensor([i for i, t in enumerate(ids) if t == IMAGE_TOKEN_ID])
    assert torch.equal(pos - pos[0], p.image_positions - p.image_positions[0])
    model = NemotronH(omni[0])
    _, greedy, gl = logits_and_greedy(model, ids, 4, 0, emb, pos)
    toks, lps = answer(got)
    assert toks == greedy.tolist()[:len(toks)]
    ref_lp = torch.log_softmax(torch.tensor(gl), -1)     # row k: the logits token k was chosen from
    for k in range(len(toks)):
        assert abs(lps[k] - float(ref_lp[k, toks[k]])) < 1e-3
    # must-fail twin: the images' embeddings exchanged give other log-probabilities
    n0 = int(p.grid_hw[0].prod()) // 4
    assert n0 * 2 == emb.shape[0]
    swapped = torch.cat([emb[n0:], emb[:n0]])
    twin = logits_and_greedy(model, ids, 0, 0, swapped, pos)[0][-1]
    assert abs(float(torch.log_softmax(torch.tensor(twin), -1)[toks[0]]) - lps[0]) > 1e-3


def test_image_order_and_content_matter(server):
    a = ok(server, [user("Look:", img(A), img(B))], cache_prompt=False)
    b = ok(server, [user("Look:", img(B), img(A))], cache_prompt=False)
    assert a["choices"][0]["prompt_token_ids"] == b["choices"][0]["prompt_token_ids"]
    assert far(a, b)


# ------------------------------------------------------------------------------------------------ snapshots
def test_same_text_other_image_does_not_reuse_the_snapshot(server):
    text = "Snapshot probe: what is in the picture?"
    first = ok(server, [user(text, img(A))])
    ids = first["choices"][0]["prompt_token_ids"]
    first_image = ids.index(IMAGE_TOKEN_ID)
    other = ok(server, [user(text, img(B))])
    assert other["choices"][0]["prompt_token_ids"] == ids          # placeholders: the same token ids
    assert cached(other) <= first_image, "a snapshot of image A served a prompt with image B"
    assert same(other, ok(server, [user(text, img(B))], cache_prompt=False))
    assert far(other, first)
    again = ok(server, [user(text, img(A))])
    last_image = len(ids) - 1 - ids[::-1].index(IMAGE_TOKEN_ID)
    assert cached(again) > last_image
    assert same(again, first)


def test_second_turn_with_the_same_image_reuses_the_snapshot_exactly(server):
    turn1 = [user("Turn one: describe", img(B), "briefly.")]
    r1 = ok(server, turn1)
    ids1 = r1["choices"][0]["prompt_token_ids"]
    reply = r1["choices"][0]["message"]["content"] or "ok"
    turn2 = turn1 + [{"role": "assistant", "content": reply}, user("And the colours?")]
    r2 = ok(server, turn2)
    last_image = len(ids1) - 1 - ids1[::-1].index(IMAGE_TOKEN_ID)
    assert cached(r2) > last_image
    full = ok(server, turn2, cache_prompt=False)
    assert cached(full) == 0
    assert same(r2, full)


def test_image_key_binds_snapshots_to_images():
    """The keying on its own, with its must-fail twin: keyed by the raw ids, image B would hit A's snapshot."""
    from gpu_worker.snapshots import SnapshotStore, image_key_ids, model_key
    from nemotron.model import InferenceState
    ids = [5, 6, 18, 18, 18, 18, 7, 8, 9]
    per = [[2, 3, 4, 5]]
    ka, kb = image_key_ids(ids, per, ["aa" * 32]), image_key_ids(ids, per, ["bb" * 32])
    assert ka[:2] == ids[:2] and ka[6:] == ids[6:] and all(t < 0 for t in ka[2:6]) and ka != kb
    moved = image_key_ids([5, 18, 18, 18, 18, 6, 7, 8, 9], [[1, 2, 3, 4]], ["aa" * 32])
    assert moved[:6] != ka[:6]
    s = SnapshotStore(model_key("c", "f", torch.float32, "cpu"), lambda: InferenceState([], 0), "cpu")
    s.put(ka[:8], InferenceState([], 8))
    assert s.lookup(kb) is None and s.lookup(ka).n_tokens == 8
    raw = SnapshotStore(model_key("c", "f", torch.float32, "cpu"), lambda: InferenceState([], 0), "cpu")
    raw.put(ids[:8], InferenceState([], 8))
    assert raw.lookup(ids) is not None       # twin: without image keys the other image's prompt would hit


# ------------------------------------------------------------------------------------------------ errors
def test_text_only_model_says_it_has_no_vision_tower(text_server):
    assert "no vision tower" in bad(text_server, A)
    ok(text_server, [user("What is this?")], max_tokens=1)       # twin: text parts are fine


def test_http_urls_need_the_flag(server, url_server):
    png = encode(40, 30, 1)

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/a.png"
        assert "--allow-image-urls" in bad(server, url)
        assert "--allow-image-urls" in bad(server, "https://example.invalid/a.png")
        by_url = ok(url_server, [user("Same?", img(url))], cache_prompt=False)
        by_data = ok(server, [user("Same?", img(A))], cache_prompt=False)
        assert same(by_url, by_data)
        from tests.server.harness import refusing_port
        with refusing_port() as port:
            assert "could not be fetched" in bad(url_server, f"http://127.0.0.1:{port}/x.png")
    finally:
        httpd.shutdown()


@pytest.mark.parametrize("path", ["/etc/hostname", "file:///etc/hostname", "./image.png", "~/image.png",
                                  "C:\\images\\a.png"])
def test_local_files_are_never_read(server, url_server, path):
    for s in (server, url_server):
        assert "local files are never read" in bad(s, path)


def test_undecodable_images(server):
    assert "could not be decoded" in bad(server, data_url(b"definitely not an image" * 10))
    truncated = encode(40, 30, 3)[:200]
    assert "could not be decoded" in bad(server, data_url(truncated))
    assert "not valid base64" in bad(server, "data:image/png;base64,@@@not-base64@@@")
    assert "base64" in bad(server, "data:image/png,rawbytes")
    assert "empty" in bad(server, "data:image/png;base64,")
    ok(server, [user("What is this?", img(data_url(encode(40, 30, 3))))], max_tokens=1)     # twin: intact


def test_unsupported_formats(server):
    assert "unsupported image format TIFF" in bad(server, data_url(encode(40, 30, 4, "TIFF")))
    assert "unsupported image type 'image/svg+xml'" in bad(server, data_url(b"<svg/>", "image/svg+xml"))
    assert "unsupported image URL scheme" in bad(server, "ftp://example.com/a.png")
    for fmt, media in (("JPEG", "image/jpeg"), ("WEBP", "image/webp"), ("GIF", "image/gif"), ("BMP", "image/bmp")):
        ok(server, [user("What is this?", img(data_url(encode(40, 30, 4, fmt), media)))], max_tokens=1)


def test_pixel_limit(server):
    msg = bad(server, data_url(encode(200, 101, 5)))
    assert "20200 pixels" in msg and f"limit of {MAX_PIXELS}" in msg and "--max-image-pixels" in msg
    ok(server, [user("What is this?", img(data_url(encode(200, 100, 5))))], max_tokens=1)   # exactly at the limit
    # one bad image among good ones fails the request; streams fail before the first byte
    assert "20200 pixels" in bad(server, [img(A), img(data_url(encode(200, 101, 5)))])
    r = chat(server, [user("x", img(data_url(encode(200, 101, 5))))], stream=True)
    assert r.status_code == 400 and "20200 pixels" in r.json()["error"]["message"]


def test_too_elongated_image_is_a_400(server):
    assert "too elongated" in bad(server, data_url(encode(1, 19999, 6)))


def test_literal_image_token_in_text_is_a_400(server):
    assert "literal <image>" in bad(server, [img(A), {"type": "text", "text": "and <image> too"}])


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/a.png", "http://[::1]/a.png", "http://10.1.2.3/a.png",
                                 "http://169.254.169.254/latest/meta-data", "http://0.0.0.0/a.png",
                                 "http://localhost/a.png", "https://192.168.0.10/a.png"])
def test_image_urls_to_internal_hosts_are_refused(url):
    """With --allow-image-urls alone, a request cannot make the server reach loopback, LAN or metadata hosts."""
    from server import images as im
    from server.errors import APIError
    with pytest.raises(APIError) as e:
        im.fetch(url, allow_urls=True)
    assert e.value.status == 400 and "non-public address" in str(e.value.message)


def test_public_literal_addresses_pass_the_destination_check():
    from server import images as im
    im.check_destination("http://8.8.8.8/a.png", allow_private=False)        # literal: no DNS needed
    im.check_destination("http://127.0.0.1/a.png", allow_private=True)     # the operator allowed LAN hosts


def test_redirect_to_an_internal_host_is_refused(tmp_path):
    """A server that redirects (here a local one, allowed for the first hop only) cannot bounce the fetch onto
    an internal address: every hop is checked."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from server import images as im
    from server.errors import APIError

    class Redirect(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(302)
            self.send_header("Location", "http://10.0.0.7/secret.png")
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = HTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    calls = []
    real = im.check_destination

    def first_hop_allowed(url, allow_private):
        calls.append(url)
        real(url, allow_private or len(calls) == 1)
    try:
        import unittest.mock as mock
        with mock.patch.object(im, "check_destination", first_hop_allowed), \
                mock.patch.dict("os.environ", {"NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}):
            with pytest.raises(APIError) as e:
                im.fetch(f"http://127.0.0.1:{srv.server_port}/a.png", allow_urls=True)
    finally:
        srv.shutdown()
    assert len(calls) == 2 and calls[1] == "http://10.0.0.7/secret.png"
    assert "non-public address" in str(e.value.message)
