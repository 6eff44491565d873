"""A by-hand check on a GPU (not collected by pytest): the synthetic omni model served by `python launcher.py`
on --device cuda (the vision tower streamed from pinned memory, bf16) and on --device cpu (fp32, resident), the
same chat request with two images sent to both; prints the answers' tokens, how many agree, the largest logprob
difference, and the GPU server's engine timings.

    python tests/server/gpu_omni_smoke.py     # from the repository root; needs fastapi/uvicorn (bench/NOTES.md)
"""
import base64
import io
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, os.getcwd())
from tools.synth_vision import synthesize_omni  # noqa: E402


def png(w, h, seed):
    arr = np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def serve_and_ask(model, device, port, body):
    p = subprocess.Popen([sys.executable, "launcher.py", "--model", model, "--device", device, "--port", str(port),
                          "--log-level", "warning", "--cache-gb", "0.001", "--max-model-len", "1024",
                          *(["--vram-gb", "8"] if device == "cuda" else [])])
    u = f"http://127.0.0.1:{port}"
    t0 = time.time()
    try:
        while time.time() - t0 < 240:
            if p.poll() is not None:
                raise SystemExit(f"{device} launcher exited with {p.returncode}")
            try:
                if httpx.get(u + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        print(f"{device}: ready in {time.time() - t0:.1f} s", flush=True)
        t = time.time()
        r = httpx.post(u + "/v1/chat/completions", json=body, timeout=300)
        r.raise_for_status()
        out = r.json()
        print(f"{device}: answered in {time.time() - t:.2f} s, usage {json.dumps(out['usage'])}", flush=True)
        return out
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(60)


def main():
    t0 = time.time()
    synthesize_omni("/tmp/omni", seed=11)
    print(f"synth omni {time.time() - t0:.1f} s", flush=True)
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": png(300, 200, 1)}},
        {"type": "text", "text": "with"}, {"type": "image_url", "image_url": {"url": png(64, 190, 2)}}]}],
        "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": True,
        "chat_template_kwargs": {"enable_thinking": False}}
    g = serve_and_ask("/tmp/omni", "cuda", 8131, body)
    c = serve_and_ask("/tmp/omni", "cpu", 8132, body)
    lg, lc = g["choices"][0]["logprobs"]["content"], c["choices"][0]["logprobs"]["content"]
    agree = 0
    for a, b in zip(lg, lc):
        if a["token"] != b["token"]:
            break
        agree += 1
    diff = max(abs(a["logprob"] - b["logprob"]) for a, b in zip(lg[:agree], lc[:agree])) if agree else float("nan")
    print(f"omni chat with two images, GPU (bf16, streamed tower) vs CPU (fp32): tokens agree {agree}/{len(lc)}, "
          f"max |logprob diff| over agreeing tokens {diff:.3g}; GPU timings {json.dumps(g.get('timings'))}")


if __name__ == "__main__":
    main()
