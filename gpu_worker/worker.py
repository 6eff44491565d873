"""The compute process: owns the streaming engine (and through it the cache processes), computes one request
at a time, streams tokens back to the launcher, and keeps conversation snapshots.

    python -m gpu_worker.worker --fd N --store STORE --cache-bytes B [...]

It talks to the launcher over one stream socket (fd N, inherited): the typed messages of `procs.messages`
(docs/serving.md lists them). A reader thread takes messages off the socket (so a cancel or a stats request is
served while a request computes); the main thread runs requests in order. A cancel stops a request within one
token. End of file on the socket (the launcher died) shuts the process down like a `Shutdown` message: the
engine stops its cache processes and unlinks every shared-memory object.
"""
from __future__ import annotations

import argparse
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch

from procs import messages as m
from procs.spawn import die_with_parent

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def log(msg: str) -> None:
    print(f"gpu_worker: {msg}", file=sys.stderr, flush=True)


class Channel:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, msg) -> None:
        data = m.encode(msg)
        with self._send_lock:
            try:
                self.sock.sendall(data)
            except OSError:
                pass        # the launcher is gone; the reader sees EOF and shuts us down

    def messages(self):
        """Raw maps as they arrive (`m.decode` types them); ends at end of file."""
        unpacker = m.unpacker()
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            unpacker.feed(data)
            yield from unpacker


@dataclass
class _PromptImages:
    """A request's images as the worker uses them: grid rows, the prompt positions of each row's tokens."""
    grid: list[tuple[int, int]]
    per_image: list[list[int]]       # per grid row: its `<image>` positions in the prompt
    digests: list[str]
    pixel_values: torch.Tensor


@dataclass
class _Request:
    """One request between its phases: what restore found, how far prefill got."""
    msg: m.Generate
    cancel: threading.Event
    t0: float
    ids: list[int]
    key: list[int]                   # what snapshots are keyed by: the ids, image tokens bound to their image
    snaps: object                    # the SnapshotStore, or None when the request does not use snapshots
    state: object = None
    restored: object = None
    cached: int = 0
    pos: int = 0
    rows: tuple | None = None        # (embeddings, positions) of the image tokens still to feed
    keep: list = field(default_factory=list)     # snapshot points the prefill still has to capture (absolute)


@dataclass
class _Decoded:
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    t_first: float | None = None
    t_last: float | None = None
    disk_at_first: int = 0
    lookups_at_start: tuple[int, int] = (0, 0)
    t_end: float = 0.0


class Worker:
    def __init__(self, engine, chan: Channel, snapshots=None, prefill_chunk: int = 0, vision=None,
                 image_geometry=None, model_dir: str | None = None):
        """vision: a `nemotron.vision.VisionTower` (`load_vision`) for an Omni / VL checkpoint, else None;
        image_geometry: its `nemotron.vision_preprocess.ImageGeometry`; model_dir: where the tokenizer is (for
        grammars). prefill_chunk: a cap on the prefill's span in tokens (0: the engine's prefill memory budget
        alone)."""
        self.engine, self.model, self.chan = engine, engine.model, chan
        self.vision, self.image_geometry = vision, image_geometry
        self.model_dir = model_dir
        self._grammars = None       # gpu_worker.grammar.GrammarCompiler, built by the first constrained request
        self.snaps = snapshots
        self.prefill_chunk = prefill_chunk
        self.prefill_budget = engine.prefill_budget_bytes
        self.jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.current: tuple[str, threading.Event] | None = None
        self.cancelled: set[str] = set()
        self.totals = dict(requests=0, prompt_tokens=0, cached_tokens=0, prefilled_tokens=0, generated_tokens=0,
                           prefill_ms=0.0, decode_ms=0.0, decode_tokens=0, decode_disk_bytes=0)

    # ---- reader thread --------------------------------------------------------------------------
    def read_loop(self) -> None:
        for obj in self.chan.messages():
            try:
                msg = m.decode(obj, m.TO_WORKER)
            except m.ProtocolError as e:
                self._on_bad_message(obj, e)
                continue
            if isinstance(msg, m.Generate):
                self.jobs.put(msg)
            elif isinstance(msg, m.Cancel):
                with self._lock:
                    if self.current is not None and self.current[0] == msg.id:
                        self.current[1].set()
                    else:
                        self.cancelled.add(msg.id)
            elif isinstance(msg, m.StatsRequest):
                self.chan.send(m.StatsReply(msg.seq, self.stats()))
            elif isinstance(msg, m.Shutdown):
                break
        with self._lock:
            if self.current is not None:
                self.current[1].set()
        self.jobs.put(None)

    def _on_bad_message(self, obj, e: m.ProtocolError) -> None:
        log(f"unreadable message from the launcher: {e}")
        rid = obj.get("id") if isinstance(obj, dict) else None
        if isinstance(rid, str) and isinstance(obj, dict) and obj.get("op") == "generate":
            self.chan.send(m.Error(rid, f"the request could not be read: {e}"))

    # ---- main thread ----------------------------------------------------------------------------
    def serve(self) -> None:
        threading.Thread(target=self.read_loop, name="worker-reader", daemon=True).start()
        while True:
            msg = self.jobs.get()
            if msg is None:
                return
            self.run(msg)

    def _lookups(self) -> tuple[int, int]:
        """The expert cache's (hits, misses) so far."""
        try:
            c = self.engine.cache_stats()
            return int(c.get("lookup_hits", 0)), int(c.get("lookup_misses", 0))
        except Exception:
            return 0, 0

    def _grammar(self, g: m.Grammar):
        """A request's grammar matcher (gpu_worker/grammar.py)."""
        if self._grammars is None:
            from gpu_worker.grammar import GrammarCompiler
            c = self.model.config
            self._grammars = GrammarCompiler(self.model_dir, c.vocab_size, c.eos_token_ids)
        return self._grammars.matcher(g.structural_tag, g.special_tokens)

    def _disk_bytes(self) -> int:
        try:
            return int(self.engine.cache_stats().get("io_bytes_read", 0))
        except Exception:
            return 0

    def run(self, msg: m.Generate) -> None:
        """One request: restore the longest snapshot, prefill the rest of the prompt, decode, report."""
        cancel = threading.Event()
        with self._lock:
            if msg.id in self.cancelled:
                self.cancelled.discard(msg.id)
                self.chan.send(m.Done(msg.id, "cancelled"))
                return
            self.current = (msg.id, cancel)
        try:
            req = self._restore(msg, cancel)
            self._prefill_prompt(req)
            self.chan.send(m.Started(msg.id, req.cached, req.restored.source if req.restored is not None else None))
            a0 = self.engine.accounting.totals()
            out = self._decode(req)
            self._finish(req, out, a0)
        except Exception as e:
            from cache_shm.client import ExpertLoadError
            log(f"request {msg.id} failed:\n{traceback.format_exc()}")
            # a block the store cannot give (read twice): every request that routes to it will fail the same way
            damaged = str(e) if isinstance(e, ExpertLoadError) else None
            self.chan.send(m.Error(msg.id, f"{type(e).__name__}: {e}", store_damaged=damaged))
        finally:
            with self._lock:
                self.current = None

    def _restore(self, msg: m.Generate, cancel: threading.Event) -> _Request:
        """The longest snapshot that is a prefix of the prompt (a fresh state when none is), and the image rows
        the snapshot does not hold yet."""
        ids = list(msg.prompt_ids)
        req = _Request(msg, cancel, time.perf_counter(), ids, ids, self.snaps if msg.use_snapshots else None)
        img = None
        if msg.images is not None:
            img = self._image_layout(msg.images, len(ids))
            from gpu_worker.snapshots import image_key_ids
            req.key = image_key_ids(ids, img.per_image, img.digests)
        if req.snaps is not None:
            try:
                req.restored = req.snaps.lookup(req.key)
            except Exception as e:      # a snapshot that cannot be restored is a miss, never a failed request
                log(f"snapshot lookup failed, computing in full: {type(e).__name__}: {e}")
        req.state = req.restored.state if req.restored is not None else self.model.new_state()
        req.cached = req.pos = req.restored.n_tokens if req.restored is not None else 0
        if img is not None:
            req.rows = self._image_rows(img, req.cached)
        return req

    def _prefill_prompt(self, req: _Request) -> None:
        """Snapshots inside the prompt (e.g. where the last message ends, before the generation prompt that the
        next turn renders differently) are taken as the prompt is prefilled, in one pass (`_keep`: the prefill
        captures the state there, so the experts that both sides route to are read once, not twice). The image
        rows go through `_prefill` here: generate() then gets only the prompt's last token (never an image token)."""
        ids, cancel = req.ids, req.cancel
        keep_at = req.msg.keep_at if req.snaps is not None else ()
        req.keep = sorted({int(k) for k in keep_at if req.cached < int(k) < len(ids)})
        if req.rows is not None:
            req.pos = self._prefill(ids, req.state, req.pos, len(ids) - 1, req.rows, cancel,
                                    capture_at=[k for k in req.keep if k < len(ids) - 1], req=req)
            if req.pos == len(ids) - 1 and len(ids) - 1 in req.keep:
                req.snaps.put(req.key[:req.pos], req.state)
            req.keep = []

    def _keep(self, req: _Request, k: int, d: dict) -> None:
        """A state captured inside the prompt after ids[:k]: kept as that prefix's snapshot."""
        req.snaps.put_host(req.key[:k], d)

    def _decode(self, req: _Request) -> _Decoded:
        """The rest of the prompt and the generated tokens, each sent as it is chosen."""
        from gpu_worker.generate import generate
        out = _Decoded()
        out.lookups_at_start = self._lookups()
        grammar = self._grammar(req.msg.grammar) if req.msg.grammar is not None else None
        if not req.cancel.is_set():
            base = req.pos
            for step in generate(self.engine, req.ids[req.pos:], req.msg.params, state=req.state,
                                 prefill_budget=self.prefill_budget, max_span=self.prefill_chunk,
                                 cancel=req.cancel, logprobs=req.msg.logprobs,
                                 grammar=grammar, context_ids=req.ids,
                                 capture_at=[k - base for k in req.keep],
                                 on_capture=lambda k, d: self._keep(req, base + k, d)):
                out.t_last = time.perf_counter()
                if out.t_first is None:
                    out.t_first = out.t_last
                    out.disk_at_first = self._disk_bytes()
                out.tokens.append(step.token)
                out.finish = step.finish_reason
                self.chan.send(m.Token(req.msg.id, step.token, step.finish_reason, step.logprob, step.top_logprobs))
        if out.finish is None:
            out.finish = "cancelled"
        if grammar is not None and grammar.rejected is not None:
            log(f"request {req.msg.id}: the grammar refused token {grammar.rejected} that its own mask allowed; "
                "the rest of the answer was not constrained")
        out.t_end = time.perf_counter()
        return out

    def _finish(self, req: _Request, out: _Decoded, a0: dict) -> None:
        """Keep the end state as a snapshot, count, and report the request's figures."""
        state, ids, cached = req.state, req.ids, req.cached
        if req.snaps is not None and state.position > 0:
            full = req.key + out.tokens
            req.snaps.put(full[:state.position], state)
        n_decode = max(len(out.tokens) - 1, 0)
        prompt_ms = ((out.t_first or out.t_end) - req.t0) * 1e3
        decode_ms = ((out.t_last - out.t_first) * 1e3) if out.t_first is not None else 0.0
        disk_decode = (self._disk_bytes() - out.disk_at_first) if out.t_first is not None else 0
        a1 = self.engine.accounting.totals()
        d = {k: a1[k] - a0[k] for k in a1}
        tot = self.totals
        tot["requests"] += 1
        tot["prompt_tokens"] += len(ids)
        tot["cached_tokens"] += cached
        tot["prefilled_tokens"] += len(ids) - cached
        tot["generated_tokens"] += len(out.tokens)
        tot["prefill_ms"] += prompt_ms
        tot["decode_ms"] += decode_ms
        tot["decode_tokens"] += n_decode
        tot["decode_disk_bytes"] += disk_decode
        timings = m.Timings(cache_n=cached, prompt_n=len(ids) - cached, prompt_ms=prompt_ms,
                            predicted_n=len(out.tokens), predicted_ms=decode_ms, decode_steps=n_decode)
        engine = m.EngineTotals(
            tokens=d["tokens"], ms_waiting_for_disk_total=d["ms_waiting_for_disk_total"],
            ms_experts_total=d["ms_experts_total"], ms_waiting_for_router_total=d["ms_waiting_for_router_total"],
            ms_bookkeeping_total=d["ms_bookkeeping_total"], bytes_over_pcie_total=d["bytes_over_pcie_total"],
            bytes_from_disk_decode_total=disk_decode,
            **{k: b - a for k, a, b in zip(("expert_lookup_hits_total", "expert_lookup_misses_total"),
                                           out.lookups_at_start, self._lookups())})
        self.chan.send(m.Done(req.msg.id, out.finish, timings, engine))

    def _prefill(self, ids, state, pos: int, end: int, rows, cancel, capture_at=(), req=None) -> int:
        """Feed ids[pos:end] (the state holds ids[:pos]) through the one prefill loop; `rows` = (embeddings
        [K, hidden], absolute positions [K]) of image tokens, whose embeddings replace the token embeddings.
        Returns the position reached: end, or 0 when cancelled (the state is then emptied)."""
        from gpu_worker.prefill import ImageRows, prefill
        keep = (lambda k, d: self._keep(req, k, d)) if capture_at else None
        prefill(self.model, ids, state, pos, end, images=ImageRows(*rows) if rows is not None else None,
                cancel=cancel, budget_bytes=self.prefill_budget, max_span=self.prefill_chunk,
                capture_at=capture_at, on_capture=keep)
        return state.position

    def _image_layout(self, img: m.Images, n_ids: int) -> _PromptImages:
        if self.vision is None:
            raise ValueError("images were sent but this model has no vision tower")
        from nemotron.vision_preprocess import image_token_count
        grid = [tuple(int(v) for v in g) for g in img.grid_hw]
        positions = list(img.positions)
        counts = [image_token_count(g, self.image_geometry) for g in grid]
        if sum(counts) != len(positions) or len(img.digests) != len(grid):
            raise ValueError(f"{len(positions)} image positions for images needing {sum(counts)}")
        if positions and (max(positions) >= n_ids - 1 or min(positions) < 0):
            raise ValueError("an image token is the last prompt token or outside the prompt")
        per_image, o = [], 0
        for c in counts:
            per_image.append(positions[o:o + c])
            o += c
        pv = torch.frombuffer(bytearray(img.pixel_values), dtype=torch.float32).reshape(img.n_rows, img.row_size)
        return _PromptImages(grid, per_image, list(img.digests), pv)

    def _image_rows(self, img: _PromptImages, cached: int):
        """Runs the tower on the images that have a token at or after `cached` (the others are in the snapshot)."""
        pv, grid = img.pixel_values, img.grid
        starts, r = [], 0
        for gh, gw in grid:
            starts.append(r)
            r += gh * gw
        need = [i for i, pos in enumerate(img.per_image) if pos and pos[-1] >= cached]
        if not need:
            return None
        sub_pv = torch.cat([pv[starts[i]:starts[i] + grid[i][0] * grid[i][1]] for i in need])
        sub_grid = torch.tensor([grid[i] for i in need], dtype=torch.long)
        with torch.inference_mode():
            emb = torch.cat(list(self.vision(sub_pv, sub_grid)))
        at = torch.tensor([p for i in need for p in img.per_image[i]], dtype=torch.long)
        return emb, at

    def stats(self) -> m.EngineStats:
        acct = self.engine.accounting
        out = m.EngineStats(requests=dict(self.totals), accounting_per_token=acct.per_token(),
                            accounting_totals=acct.totals(), prefill=self.engine.experts.prefill_acct.totals())
        try:
            cs = self.engine.cache_stats()
            out.cache = {k: v for k, v in cs.items() if isinstance(v, (int, float))}
        except Exception as e:
            out.cache = {"error": str(e)}
        if self.snaps is not None:
            out.snapshots = self.snaps.info()
        return out


def load_vision(model_dir, device, dtype, chan=None):
    """(tower, its image geometry, device bytes to keep free for its activations) for an Omni / VL checkpoint,
    else (None, None, 0).

    On a GPU the tower's weights stay in pinned host memory and stream to two device slots block by block
    (`gpu_worker.weight_stream`); on the CPU they are used in place."""
    if not model_dir:
        return None, None, 0
    from nemotron.checkpoint import Checkpoint
    ckpt = Checkpoint(model_dir)
    mm = ckpt.config.multimodal
    if mm is None or not mm.get("vision_config"):
        return None, None, 0
    from nemotron.vision import VisionTower
    from nemotron.vision_preprocess import TILED, ImageGeometry
    if chan is not None:
        chan.send(m.Status("loading the vision tower"))
    cuda = str(device).startswith("cuda")
    if cuda:
        from gpu_worker.weight_stream import StreamedWeights
        tower = VisionTower.from_checkpoint(ckpt, mm, dtype=dtype, device=device, holder=StreamedWeights)
    else:
        tower = VisionTower.from_checkpoint(ckpt, mm, dtype=dtype, device=device)
    geom = ImageGeometry.from_model_dir(model_dir)
    most = geom.max_num_patches or 13312
    if geom.scheme == TILED:      # tiles run as separate sequences: the largest is one tile
        most = (geom.image_size // geom.patch_size) ** 2
    return tower, geom, tower.activation_bytes(most) if cuda else 0


def parse_args(argv=None) -> argparse.Namespace:
    """The worker's command line (what server/worker_client.py `WorkerConfig.args` writes)."""
    ap = argparse.ArgumentParser(prog="python -m gpu_worker.worker", description=__doc__.split("\n\n")[0])
    ap.add_argument("--fd", type=int, required=True, help="the inherited socket to the launcher")
    ap.add_argument("--store", required=True)
    ap.add_argument("--model", help="the checkpoint the store was made from (checked)")
    ap.add_argument("--cache-bytes", type=int, required=True)
    ap.add_argument("--io-workers", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--prefill-chunk", type=int, default=0,
                    help="cap on the prefill span in tokens (0: the prefill memory budget alone decides)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--vram-bytes", type=int, help="device budget: the dense part, then a VRAM tier of hot experts")
    ap.add_argument("--prefill-reserve-bytes", type=int, default=0,
                    help="device bytes kept beside the VRAM tier for prefill activations and KV (0: automatic)")
    ap.add_argument("--cache-policy", default="reuse", help="the RAM cache's eviction policy (prefetcher/policy.py)")
    ap.add_argument("--warm-cache", choices=["auto", "off"], default="auto",
                    help="auto: where the RAM cache holds every expert, read the whole store into it from the start")
    ap.add_argument("--snapshot-dir")
    ap.add_argument("--snapshot-count", type=int, default=32)
    ap.add_argument("--snapshot-ram-bytes", type=int, default=2 << 30)
    ap.add_argument("--snapshot-disk-count", type=int, default=64)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # the launcher decides when we stop
    chan = Channel(socket.socket(fileno=a.fd))
    if a.threads:
        torch.set_num_threads(a.threads)
    chan.send(m.Status("starting the cache processes and loading the dense weights"))
    from gpu_worker.engine import StreamingEngine
    from gpu_worker.snapshots import SnapshotStore, model_key
    dtype = DTYPES[a.dtype]
    try:
        # the tower first: its device slots then count as used when the VRAM tier is sized from the budget
        vision, image_geometry, vision_reserve = load_vision(a.model, a.device, dtype, chan)
        # the prefill's room beside the VRAM tier: --prefill-reserve-bytes, else 512 MiB and a share of what the
        # dense part leaves (gpu_worker/vram_tier.py prefill_reserve_bytes); the tower's slots on top
        reserve = (a.prefill_reserve_bytes or (512 << 20)) + vision_reserve
        engine = StreamingEngine(a.store, cache_bytes=a.cache_bytes, io_workers=a.io_workers, device=a.device,
                                 dtype=dtype, model_dir=a.model, vram_reserve_bytes=reserve,
                                 prefill_share=not a.prefill_reserve_bytes, warm_cache=a.warm_cache == "auto",
                                 policy=a.cache_policy,
                                 vram_bytes=a.vram_bytes if str(a.device).startswith("cuda") else None)
    except Exception as e:
        log(traceback.format_exc())
        chan.send(m.Fatal(f"loading {a.store} failed: {type(e).__name__}: {e}"))
        return 2
    snaps = None
    lost = []
    try:
        manifest = engine.store.manifest
        key = model_key(manifest["config_hash"], manifest.get("checkpoint_fingerprint", ""), dtype, a.device)
        snaps = SnapshotStore(key, engine.model.new_state, a.device, max_count=a.snapshot_count,
                              max_bytes=a.snapshot_ram_bytes, directory=a.snapshot_dir,
                              max_disk_count=a.snapshot_disk_count, log=log)
        c = engine.model.config
        chan.send(m.Ready(m.WorkerInfo(
            pid=os.getpid(), device=a.device, dtype=a.dtype, vocab_size=c.vocab_size,
            eos_token_ids=list(c.eos_token_ids), model_key=key, cache_prefix=engine.sup.prefix,
            cache_child_pids=engine.sup.child_pids(), snapshots_on_disk=len(snaps.disk))))
        worker = Worker(engine, chan, snaps, a.prefill_chunk, vision, image_geometry, model_dir=a.model or a.store)

        def cache_lost(why: str) -> None:       # the supervisor gave up: say so, stop serving, exit non-zero
            lost.append(why)
            chan.send(m.Fatal(f"the expert cache's processes cannot be kept alive: {why}"))
            worker.jobs.put(None)
        engine.sup.on_failure = cache_lost
        if engine.sup.failed:
            cache_lost(engine.sup.failed)
        worker.serve()
    finally:
        if snaps is not None:
            snaps.close()
        engine.close()
    return 3 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
