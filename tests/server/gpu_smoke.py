"""A by-hand check of the server on a GPU (not collected by pytest): the tiny synthetic model on --device cuda,
a chat turn, a second turn from its snapshot against a full prefill, a stream, the engine metrics, SIGTERM.

    python -m pip install fastapi uvicorn posix_ipc  # into the interpreter that has the CUDA torch (`python -m`!)
    python tests/server/gpu_smoke.py                 # from the repository root

On the lent H200 (no network): `pip download --python-version 3.12 --only-binary=:all: fastapi==0.165.0
uvicorn==0.54.0 -d build/gpuwheels` here, carry build/gpuwheels and .whl, and there run
`python -m pip install --no-index --find-links build/gpuwheels fastapi uvicorn .whl/posix_ipc-*.whl`.
Not run yet: the one attempt installed the packages with the system pip, not the venv's.
"""
import json, os, signal, subprocess, sys, time, httpx
sys.path.insert(0, os.getcwd())
t0 = time.time()
from tools.synth import synthesize
synthesize("/tmp/tiny", preset="tiny", quant="nvfp4", seed=0)
print("synth", round(time.time() - t0, 1), flush=True)
p = subprocess.Popen([sys.executable, "launcher.py", "--model", "/tmp/tiny", "--device", "cuda", "--port", "8123",
                      "--log-level", "warning", "--snapshot-dir", "/tmp/snaps"])
u = "http://127.0.0.1:8123"
while time.time() - t0 < 150:
    try:
        if httpx.get(u + "/health").status_code == 200: break
    except httpx.TransportError: pass
    time.sleep(0.3)
print("ready", round(time.time() - t0, 1), flush=True)
nt = {"chat_template_kwargs": {"enable_thinking": False}}
m = [{"role": "user", "content": "Name a colour."}]
r1 = httpx.post(u + "/v1/chat/completions", json={"messages": m, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **nt}, timeout=120).json()
print("turn1", json.dumps(r1["usage"]), r1["timings"]["predicted_per_second"], flush=True)
m2 = m + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]}, {"role": "user", "content": "Another."}]
a = httpx.post(u + "/v1/chat/completions", json={"messages": m2, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": True, **nt}, timeout=120).json()
b = httpx.post(u + "/v1/chat/completions", json={"messages": m2, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": True, "cache_prompt": False, **nt}, timeout=120).json()
print("turn2 cached", a["usage"]["prompt_tokens_details"], "same", a["choices"][0]["message"] == b["choices"][0]["message"],
      max(abs(x["logprob"] - y["logprob"]) for x, y in zip(a["choices"][0]["logprobs"]["content"], b["choices"][0]["logprobs"]["content"])), flush=True)
with httpx.stream("POST", u + "/v1/completions", json={"prompt": "The fox", "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}) as r:
    ev = [l for l in r.iter_lines() if l.startswith("data: ")]
print("stream", len(ev), ev[-1], flush=True)
print("\n".join(l for l in httpx.get(u + "/metrics").text.splitlines() if l.startswith(("moestream_bytes", "moestream_ms_per", "moestream_expert_cache_hit", "moestream_snapshots"))), flush=True)
p.send_signal(signal.SIGTERM)
print("rc", p.wait(60), "shm", [e for e in os.listdir("/dev/shm") if "moestream" in e], "t", round(time.time() - t0, 1), flush=True)
