"""moestream launcher: the OpenAI-compatible server of a NemotronH MoE model whose routed experts stream from
NVMe through a shared-memory RAM cache.

    python launcher.py                                  # the tiny synthetic demo model (random weights)
    python launcher.py --model DIR --cache-gb 20        # a checkpoint (repacked once into DIR.moestream-store)
    python launcher.py --store STORE --cache-gb 20      # an expert store made by `python -m tools.repack`

This process runs the HTTP API (FastAPI + uvicorn) and supervises the compute process (`gpu_worker.worker`),
which owns the engine and the cache processes. It checks RAM, /dev/shm and VRAM against the flags before it
starts anything; /health answers 503 while the model loads and 200 when it serves. SIGTERM or Ctrl-C drains
(in-flight and queued requests finish, up to --shutdown-timeout), stops every child and unlinks every
shared-memory object; a second signal exits at once. Under systemd (Type=notify) it reports READY, STATUS,
STOPPING and EXTEND_TIMEOUT_USEC.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

GiB = 1 << 30
ROOT = Path(__file__).resolve().parent
STOP_GRACE_S = 1.0      # the least time the compute process gets to stop in order after the drain


def log(msg: str) -> None:
    print(f"moestream: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ the model
def demo_model_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "moestream"
    return cache / "demo-tiny-nvfp4"


def ensure_demo_model() -> Path:
    out = demo_model_dir()
    if not (out / "config.json").exists():
        log(f"writing a tiny synthetic demo model to {out} (once)")
        tmp = out.with_name(out.name + ".partial")
        if tmp.exists():
            shutil.rmtree(tmp)
        # the synthesizer is a tool, run as one like tools.repack below: the launcher imports no tools
        r = subprocess.run([sys.executable, "-m", "tools.synth", "--preset", "tiny", "--quant", "nvfp4", "--seed", "0",
                            "--out", str(tmp)], cwd=str(ROOT))
        if r.returncode != 0:
            raise RuntimeError(f"writing the demo model failed (exit code {r.returncode})")
        tmp.rename(out)
    return out


def store_is_complete(store: Path) -> bool:
    return (store / "manifest.json").exists()


def sizes(model: Path | None, store: Path, down_group_neurons: int = 16) -> tuple[int, int, int]:
    """(dense bytes, routed-expert bytes as stored, block stride) from the store, else from the checkpoint as a store
    of down (sub-)groups of `down_group_neurons` would hold them."""
    if store_is_complete(store):
        from expert_store.reader import ExpertStore
        st = ExpertStore.open(store)
        dense = sum(p.stat().st_size for p in st.dense_files if p.exists())
        n_blocks = len(st.moe_layers) * st.n_experts
        return dense, n_blocks * st.block_stride, st.block_stride
    from expert_store.source import make_plan
    plan = make_plan(model, down_group_neurons=down_group_neurons)
    dense = sum(plan.infos[n].nbytes for n in plan.dense_names)
    return dense, plan.experts_bytes, plan.geometry.block_stride


# The store's down (sub-)group size when the launcher repacks (issue 15, measured on the H200's super shape, 4 MoE
# layers, bench/NOTES.md sessions 8, 9 and 11): where the cache holds every expert (the RAM regime) groups of 8 read
# 24 % fewer down bytes and decode 7-10 % faster (session 11: 5.65 -> 5.11 ms/token), while a prompt's prefill is 5-14 %
# slower (bigger blocks over the bus); where blocks come from disk the 5.6 % bigger blocks cost the disk regime 10 %.
# A chat turn is mostly decode, so: 8 for an NVFP4 model on a GPU whose --cache-gb holds the whole store, else 16.
RAM_REGIME_DOWN_GROUPS = 8


def down_groups_for(a, model: Path) -> int:
    """--down-group-neurons, or for `auto` the size the regime of this start calls for (see above)."""
    if a.down_group_neurons != "auto":
        return int(a.down_group_neurons)
    if not a.device.startswith("cuda"):
        return 16
    from expert_store.source import make_plan
    plan = make_plan(model, down_group_neurons=RAM_REGIME_DOWN_GROUPS)
    if plan.geometry.fmt != "nvfp4" or a.cache_gb * GiB < plan.experts_bytes:
        return 16
    return RAM_REGIME_DOWN_GROUPS


# ------------------------------------------------------------------------------------------------ checks
def mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def free_vram(device: str) -> int | None:
    """Free bytes on the GPU, from nvidia-smi (querying through torch would hold a CUDA context in this process
    for its whole life, which costs VRAM the model needs)."""
    index = device.split(":", 1)[1] if ":" in device else "0"
    try:
        r = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=10)
        return int(r.stdout.strip().splitlines()[0]) << 20 if r.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


SHM_MARGIN = 64 << 20      # beside the slab: the index, rings and counters, with room to spare


def size_text(n: int) -> str:
    """GiB with two decimals, MiB below 1 GiB (a small cache is not "0.00 GiB")."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


def preflight(a, cache_bytes: int, dense_bytes: int, snapshot_bytes: int) -> list[str]:
    """What stands in the way of starting with these flags, each with what to change."""
    problems = []
    gb = size_text
    try:
        shm_free = shutil.disk_usage("/dev/shm").free
    except OSError:
        shm_free = None
    margin = SHM_MARGIN
    if shm_free is not None and cache_bytes + margin > shm_free:
        most = max(shm_free - margin, 0) / GiB
        problems.append(f"--cache-gb {a.cache_gb:g} needs {gb(cache_bytes + margin)} in /dev/shm (the cache, "
                        f"{gb(cache_bytes)}, plus a margin of {gb(margin)} for the index and rings), which has "
                        f"{gb(shm_free)} free: lower --cache-gb to at most "
                        f"{f'{most:.1f}' if most >= 0.1 else f'{most:.4f}'}, or enlarge /dev/shm "
                        f"(`mount -o remount,size=40G /dev/shm`; in Docker `--shm-size`)")
    avail = mem_available()
    host_dense = dense_bytes if a.device == "cpu" else 0
    need = cache_bytes + host_dense + (512 << 20)
    if avail is not None and need > avail:
        what = f"the cache ({gb(cache_bytes)})" + (f" + the dense weights on the CPU ({gb(host_dense)})" if host_dense
                                                   else "") + " + 0.5 GiB"
        problems.append(f"RAM: {what} need {gb(need)}, but {gb(avail)} is available: lower --cache-gb to at most "
                        f"{max(avail - host_dense - (512 << 20), 0) / GiB:.1f}")
    elif avail is not None and need + snapshot_bytes > avail:
        log(f"warning: with the snapshot budget (--snapshot-ram-gb {a.snapshot_ram_gb:g}) RAM could run short "
            f"({gb(need + snapshot_bytes)} of {gb(avail)} available); lower --snapshot-ram-gb if it does")
    prefill_gb = getattr(a, "prefill_gb", None)
    if prefill_gb is not None and prefill_gb <= 0:
        problems.append(f"--prefill-gb {prefill_gb:g}: expected a size above 0 GiB (leave it out for the automatic "
                        f"share)")
    if a.device.startswith("cuda"):
        free = free_vram(a.device)
        budget = int(a.vram_gb * GiB) if a.vram_gb else free
        if budget is not None and free is not None:
            budget = min(budget, free)
        if a.vram_gb and free is not None and int(a.vram_gb * GiB) > free:
            problems.append(f"--vram-gb {a.vram_gb:g}: the GPU has only {gb(free)} free: lower --vram-gb or free the "
                            f"GPU")
        if budget is not None and dense_bytes + (256 << 20) > budget:
            problems.append(f"VRAM: the dense part of the model needs {gb(dense_bytes)} (+0.25 GiB of state) but the "
                            f"budget is {gb(budget)}" + (" (--vram-gb, and free on the GPU)" if a.vram_gb else
                                                         " (free on the GPU)") +
                            ": use a GPU with more memory, or --device cpu")
        if free is None:
            log("note: nvidia-smi did not answer; VRAM not checked")
        # the budget the compute process divides (dense part, then the VRAM tier of hot experts): --vram-gb, else
        # what is free less 1 GiB for the CUDA context and libraries' workspaces (outside torch's allocator)
        a.vram_budget = int(a.vram_gb * GiB) if a.vram_gb else (max(free - GiB, 0) if free is not None else None)
    return problems


# ------------------------------------------------------------------------------------------------ serving
def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python launcher.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (HuggingFace layout); default: the synthetic demo model")
    ap.add_argument("--store", help="expert store directory (default: MODEL.moestream-store, made on first start)")
    ap.add_argument("--cache-gb", type=float, default=4.0,
                    help="RAM cache of expert blocks in /dev/shm, GiB (fractions allowed; capped at the store size)")
    ap.add_argument("--vram-gb", type=float, default=None, help="GPU memory budget, GiB: the dense part, then hot experts in a VRAM tier "
                    "(default: what is free less 1 GiB)")
    ap.add_argument("--prefill-gb", type=float, default=None,
                    help="GPU memory kept beside the VRAM tier for a prompt's activations and the KV caches, GiB "
                         "(default: 0.5 and an eighth of what the dense part leaves of --vram-gb, at most 1; long "
                         "prompts run faster with more: 16k tokens took half the time at 1 GiB as at 0.5, at the "
                         "cost of the VRAM tier's slots)")
    ap.add_argument("--cache-policy", choices=["reuse", "lru", "lfu", "lrfu", "slru", "arc"], default="reuse",
                    help="which expert the RAM cache evicts (reuse: the least likely used at its layer's next token, "
                         "learnt from the decode; lru: the least recently used; docs/cache.md)")
    ap.add_argument("--warm-cache", choices=["auto", "off"], default="auto",
                    help="auto: when --cache-gb holds every expert, the store is read into the cache from the start, "
                         "behind any prompt's reads, so the first prompts read nothing from disk (off: as they come)")
    ap.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda when available)")
    ap.add_argument("--down-group-neurons", default="auto", choices=["auto", "16", "8", "4", "2", "1"],
                    help="when the store is made (first start): its down projection in sub-groups of N neurons, read "
                         "only where one fires (auto: 8 for an NVFP4 model on a GPU whose --cache-gb holds every "
                         "expert, else 16; an existing store keeps its own)")
    ap.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                    help="compute dtype (auto: bf16 on a GPU, fp32 on the CPU)")
    ap.add_argument("--io-workers", type=int, default=4, help="IO worker processes reading expert blocks")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads in the compute process (0: default)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0: a free port, named in the 'listening on' line")
    ap.add_argument("--api-key", default=None, help="require this bearer key on /v1/* and /tokenize, /detokenize "
                                                    "(default: $MOESTREAM_API_KEY; unset: no key)")
    ap.add_argument("--served-model-name", default=None, help="the model id in the API (default: the directory name)")
    ap.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    ap.add_argument("--default-chat-template-kwargs", type=json.loads, default=None, metavar="JSON",
                    help="chat template variables for requests that do not set them, e.g. '{\"enable_thinking\": "
                         "false}' (default: none; the demo model: thinking off, so its text shows as content)")
    ap.add_argument("--allow-image-urls", action="store_true",
                    help="let chat requests name images by http(s) URL, fetched by the server (default: only base64 "
                         "data URLs; local file paths are never read)")
    ap.add_argument("--allow-private-image-urls", action="store_true",
                    help="with --allow-image-urls: also fetch from hosts that resolve to loopback, private, link-local "
                         "or reserved addresses (a LAN image server); by default they are refused, so a request cannot "
                         "make the server reach its own or the network's internal services")
    ap.add_argument("--max-image-pixels", type=int, default=50_000_000,
                    help="images with more pixels (width x height) get a 400 (default 50 megapixels)")
    ap.add_argument("--max-tokens-default", type=int, default=2048,
                    help="tokens a request may generate when it sets no max_tokens (default 2048: minutes, not hours, "
                         "at a few tokens per second; reported in /v1/models)")
    ap.add_argument("--max-body-mb", type=float, default=None,
                    help="larger request bodies get a 413, read no further than the limit (default: 16 MiB + 64 bytes "
                         "per token of the context)")
    ap.add_argument("--max-queue", type=int, default=64, help="requests that may wait; more get 503 + Retry-After")
    ap.add_argument("--snapshot-dir", default=None, help="keep conversation snapshots on disk here too (reloaded at "
                                                         "start)")
    ap.add_argument("--snapshot-ram-gb", type=float, default=2.0, help="RAM budget of conversation snapshots, GiB")
    ap.add_argument("--snapshots", type=int, default=32, help="most snapshots kept in RAM")
    ap.add_argument("--snapshot-disk-count", type=int, default=64, help="most snapshots kept on disk")
    ap.add_argument("--prefill-chunk", type=int, default=0,
                    help="cap on the prefill span in tokens (0: the prefill memory budget alone decides)")
    ap.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="seconds a signal waits for in-flight and queued requests before aborting them")
    ap.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return ap.parse_args(argv)


def port_problem(host: str, port: int) -> str | None:
    """Why the HTTP port cannot be had (checked before anything loads), or None."""
    import errno
    import socket
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        return f"--host {host}: cannot resolve it ({e})"
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as uvicorn binds
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is in use (another server?): stop it or choose another --port"
            return f"cannot listen on {host}:{port}: {e.strerror or e}"
    return None


def device_problem(device: str) -> str | None:
    """Why --device cannot be used, or None."""
    if not device.startswith("cuda"):
        return None
    import torch
    if not torch.cuda.is_available():
        return f"--device {device}, but no CUDA GPU is visible to torch: use --device cpu (or auto)"
    index = int(device.split(":", 1)[1]) if ":" in device and device.split(":", 1)[1].isdigit() else 0
    if index >= torch.cuda.device_count():
        return f"--device {device}, but only {torch.cuda.device_count()} CUDA GPU(s) are visible"
    return None


def main(argv=None) -> int:
    a = parse_args(argv)
    # flags that cannot work are one line and exit status 2, before anything is loaded or written
    if a.max_tokens_default < 1:
        log(f"error: --max-tokens-default {a.max_tokens_default}: must be at least 1")
        return 2
    for problem in (port_problem(a.host, a.port), device_problem(a.device)):
        if problem:
            log(f"error: {problem}")
            return 2
    a.api_key = a.api_key or os.environ.get("MOESTREAM_API_KEY") or None
    demo = not a.model and not a.store
    model = Path(a.model) if a.model else (ensure_demo_model() if demo else None)
    if demo:
        log("note: no --model given; serving a tiny synthetic demo model. Its weights are RANDOM, so its text is "
            "gibberish by design. Give --model DIR to serve a real checkpoint.")
        if a.default_chat_template_kwargs is None:
            a.default_chat_template_kwargs = {"enable_thinking": False}   # random weights never close <think>
    store = Path(a.store) if a.store else Path(str(model).rstrip("/") + ".moestream-store")
    if model is not None and not (model / "config.json").exists():
        log(f"error: {model} is not a checkpoint directory (no config.json)")
        return 2
    if model is None and not store_is_complete(store):
        log(f"error: {store} is not a complete expert store (no manifest.json); give --model to make one")
        return 2
    if a.device == "auto":
        import torch
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.dtype == "auto":
        a.dtype = "fp32" if a.device == "cpu" else "bf16"
    try:
        a.repack_down_groups = None if store_is_complete(store) else down_groups_for(a, model)
        dense_bytes, expert_bytes, stride = sizes(model, store, a.repack_down_groups or 16)
    except Exception as e:
        log(f"error: cannot read the model: {type(e).__name__}: {e}")
        return 2
    if a.repack_down_groups is None and a.down_group_neurons != "auto":
        log(f"note: {store} exists, so --down-group-neurons {a.down_group_neurons} is not applied (repack it with "
            f"`python -m tools.repack --down-group-neurons {a.down_group_neurons}` to change it)")
    cache_bytes = min(int(a.cache_gb * GiB), expert_bytes)
    if cache_bytes < stride:
        log(f"error: --cache-gb {a.cache_gb:g} holds no expert block ({stride:,} bytes each): raise it")
        return 2
    snapshot_bytes = int(a.snapshot_ram_gb * GiB)
    problems = preflight(a, cache_bytes, dense_bytes, snapshot_bytes)
    if problems:
        for p in problems:
            log(f"error: {p}")
        return 2
    try:
        return asyncio.run(serve(a, model, store, cache_bytes, snapshot_bytes))
    except KeyboardInterrupt:
        return 130


async def relay_progress(stream, state) -> None:
    """The repack's stderr goes on to ours; its progress bar's percentage goes to /health ("repacking (n %)")."""
    import re
    while chunk := await stream.read(4096):
        sys.stderr.buffer.write(chunk)
        sys.stderr.flush()
        done = re.findall(rb"(\d+)%\|", chunk)
        if done:
            state.loading = f"repacking ({int(done[-1])} %)"


def make_server(config):
    """uvicorn.Server without its own signal handling: the launcher drains and stops in its own order."""
    import uvicorn

    class NoSignalServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return NoSignalServer(config)


async def serve(a, model: Path | None, store: Path, cache_bytes: int, snapshot_bytes: int) -> int:
    import uvicorn

    from server.app import ServerSettings, ServerState, create_app
    from server.sdnotify import notify
    from server.worker_client import WorkerClient, WorkerConfig

    loop = asyncio.get_running_loop()
    meta_dir = model if model is not None else store
    client = WorkerClient(WorkerConfig(
        store=str(store), model=str(model) if model is not None else None, cache_bytes=cache_bytes,
        io_workers=a.io_workers, device=a.device, dtype=a.dtype, prefill_chunk=a.prefill_chunk, threads=a.threads,
        snapshot_dir=a.snapshot_dir, snapshot_count=a.snapshots, snapshot_ram_bytes=snapshot_bytes,
        snapshot_disk_count=a.snapshot_disk_count,
        vram_bytes=getattr(a, "vram_budget", None),
        prefill_reserve_bytes=int(a.prefill_gb * GiB) if a.prefill_gb else 0, warm_cache=a.warm_cache,
        cache_policy=a.cache_policy),
        max_queue=a.max_queue, log=log)
    client.on_status = lambda s: notify(f"STATUS={s}")
    name = a.served_model_name or meta_dir.name.removesuffix(".moestream-store")
    state = ServerState(ServerSettings(model_name=name, model_dir=str(meta_dir), store_dir=str(store),
                                       max_model_len=a.max_model_len, api_key=a.api_key,
                                       chat_template_kwargs=a.default_chat_template_kwargs or {},
                                       allow_image_urls=a.allow_image_urls,
                                       allow_private_image_urls=a.allow_private_image_urls,
                                       max_image_pixels=a.max_image_pixels,
                                       max_body_bytes=int(a.max_body_mb * (1 << 20)) if a.max_body_mb else None,
                                       max_tokens_default=a.max_tokens_default, log_level=a.log_level),
                          client)
    server = make_server(uvicorn.Config(create_app(state), host=a.host, port=a.port, log_level=a.log_level,
                                    timeout_graceful_shutdown=5, lifespan="off"))
    stop = asyncio.Event()
    signals = []
    drain_until = [None]        # loop time: the first signal plus --shutdown-timeout
    exit_code = [0]
    repack_proc = [None]

    def on_signal(sig):
        signals.append(sig)
        if len(signals) == 1:
            log(f"{signal.Signals(sig).name}: draining (up to {a.shutdown_timeout:g} s); a second signal exits at once")
            drain_until[0] = loop.time() + a.shutdown_timeout
            stop.set()
        else:
            log("second signal: exiting at once")
            client.kill_now()
            if repack_proc[0] is not None and repack_proc[0].returncode is None:
                repack_proc[0].kill()
            os._exit(128 + sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    serve_task = asyncio.create_task(server.serve())
    while not server.started:
        if serve_task.done() or stop.is_set():
            log(f"error: could not serve on {a.host}:{a.port}")
            return 2
        await asyncio.sleep(0.02)
    if a.port == 0:
        a.port = server.servers[0].sockets[0].getsockname()[1]
    log(f"listening on http://{a.host}:{a.port} (loading; /health answers 503 until the model is ready)")

    async def keep_extending():
        while True:     # systemd's start timeout: each message buys 60 more seconds while we load
            notify("EXTEND_TIMEOUT_USEC=60000000")
            await asyncio.sleep(15)

    async def load():
        ext = asyncio.create_task(keep_extending())
        try:
            tok = asyncio.create_task(asyncio.to_thread(state.load_tokenizer))
            if not store_is_complete(store):
                notify(f"STATUS=repacking {model} into {store}")
                log(f"repacking {model} into the expert store {store} (once; resumable)")
                state.loading = "repacking (0 %)"
                n = a.repack_down_groups or 16
                if n != 16:
                    log(f"down groups of {n} neurons: the cache holds every expert, where they decode faster")
                p = repack_proc[0] = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "tools.repack", "--model", str(model), "--out", str(store),
                    "--down-group-neurons", str(n), cwd=str(ROOT), stderr=asyncio.subprocess.PIPE)
                await relay_progress(p.stderr, state)
                if await p.wait() != 0:
                    raise RuntimeError(f"repacking {model} failed (exit code {p.returncode})")
            state.loading = "loading"
            notify("STATUS=loading the model")
            await client.start()
            await tok
        finally:
            ext.cancel()
        notify("READY=1", f"STATUS=serving {state.settings.model_name} on {a.host}:{a.port}")
        info = client.info
        size = size_text(cache_bytes)
        log(f"ready: {state.settings.model_name} on {info.device} ({info.dtype}), expert cache {size}; "
            f"OpenAI API at http://{a.host}:{a.port}/v1")

    load_task = asyncio.create_task(load())
    failed = asyncio.create_task(client._failed.wait())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({load_task, failed, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if load_task.done() and load_task.exception() is None:
        await asyncio.wait({failed, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if load_task.done() and load_task.exception() is not None:
        log(f"error: {load_task.exception()}")
        exit_code[0] = 1
    elif failed.done():
        log(f"error: {client.fatal}")
        exit_code[0] = 1

    # ---- shutdown: drain, stop the worker (and through it the cache processes), stop HTTP --------------------
    state.draining = True
    notify("STOPPING=1", "STATUS=draining")
    if not load_task.done():
        load_task.cancel()
        if repack_proc[0] is not None and repack_proc[0].returncode is None:
            repack_proc[0].terminate()
            await repack_proc[0].wait()
    # One deadline for the drain and the stop: what the drain leaves (at least STOP_GRACE_S) is the compute
    # process's time to stop in order; then its process group is killed and the shared memory swept.
    deadline = drain_until[0] if drain_until[0] is not None else loop.time()
    if client.state == "ready" and not await client.wait_idle(max(deadline - loop.time(), 0.0)):
        log(f"shutdown timeout ({a.shutdown_timeout:g} s): aborting the remaining requests")
    await client.stop(max(deadline - loop.time(), STOP_GRACE_S))
    await asyncio.sleep(0.05)          # let aborted responses send their last event
    server.should_exit = True
    with contextlib.suppress(Exception):
        await serve_task
    for t in (failed, stopper):
        t.cancel()
    log("stopped")
    return exit_code[0]


if __name__ == "__main__":
    code = main()
    # Everything is stopped and unlinked by now; what remains is tearing down torch's and transformers' modules,
    # which took 2.4 s here on a busy host and counts against --shutdown-timeout (systemd's stop timeout).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
