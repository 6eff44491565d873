"""The compute process: owns the streaming engine (and through it the cache processes), computes one request
at a time, streams tokens back to the launcher, and keeps conversation snapshots.

    python -m gpu_worker.worker --fd N --store STORE --cache-bytes B [...]

It talks to the launcher over one stream socket (fd N, inherited), msgpack maps in both directions:

    launcher -> worker   {op: generate, id, prompt_ids, params, logprobs, keep_at[, images]}
                         images: {pixel_values (fp32 LE bytes), n_rows, row_size, grid_hw, positions, digests}
                         {op: cancel, id}   {op: stats, seq}   {op: shutdown}
    worker -> launcher   {op: status, message}   {op: ready, info}   {op: fatal, message}
                         {op: start, id, cached_tokens}   {op: token, id, t, f, lp, top}
                         {op: done, id, finish_reason, timings, engine}   {op: error, id, message}
                         {op: stats, seq, data}

A reader thread takes messages off the socket (so a cancel or a stats request is served while a request
computes); the main thread runs requests in order. A cancel stops a request within one token. End of file on
the socket (the launcher died) shuts the process down like a `shutdown` message: the engine stops its cache
processes and unlinks every shared-memory object.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback

import msgpack
import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def log(msg: str) -> None:
    print(f"gpu_worker: {msg}", file=sys.stderr, flush=True)


class Channel:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, msg: dict) -> None:
        data = msgpack.packb(msg, use_bin_type=True)
        with self._send_lock:
            try:
                self.sock.sendall(data)
            except OSError:
                pass        # the launcher is gone; the reader sees EOF and shuts us down

    def messages(self):
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=1 << 30)
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            unpacker.feed(data)
            yield from unpacker


class Worker:
    def __init__(self, engine, chan: Channel, snapshots=None, prefill_chunk: int = 0, vision=None):
        """vision: a `nemotron.vision.VisionTower` (`load_vision`) for an Omni / VL checkpoint, else None.
        prefill_chunk: a cap on the prefill's span in tokens (0: the engine's prefill memory budget alone)."""
        self.engine, self.model, self.chan = engine, engine.model, chan
        self.vision = vision
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
        for msg in self.chan.messages():
            op = msg.get("op")
            if op == "generate":
                self.jobs.put(msg)
            elif op == "cancel":
                with self._lock:
                    if self.current is not None and self.current[0] == msg["id"]:
                        self.current[1].set()
                    else:
                        self.cancelled.add(msg["id"])
            elif op == "stats":
                self.chan.send({"op": "stats", "seq": msg.get("seq"), "data": self.stats()})
            elif op == "shutdown":
                break
        with self._lock:
            if self.current is not None:
                self.current[1].set()
        self.jobs.put(None)

    # ---- main thread ----------------------------------------------------------------------------
    def serve(self) -> None:
        threading.Thread(target=self.read_loop, name="worker-reader", daemon=True).start()
        while True:
            msg = self.jobs.get()
            if msg is None:
                return
            self.run(msg)

    def _disk_bytes(self) -> int:
        try:
            return int(self.engine.cache_stats().get("io_bytes_read", 0))
        except Exception:
            return 0

    def run(self, msg: dict) -> None:
        from gpu_worker.generate import generate
        from gpu_worker.sampling import SamplingParams
        rid = msg["id"]
        cancel = threading.Event()
        with self._lock:
            if rid in self.cancelled:
                self.cancelled.discard(rid)
                self.chan.send({"op": "done", "id": rid, "finish_reason": "cancelled", "timings": {}, "engine": {}})
                return
            self.current = (rid, cancel)
        ids = [int(t) for t in msg["prompt_ids"]]
        snaps = self.snaps if msg.get("use_snapshots", True) else None
        t0 = time.perf_counter()
        try:
            img = msg.get("images")
            key = ids          # what snapshots are keyed by: the ids, with image tokens bound to their image
            if img:
                img = self._image_layout(img, len(ids))
                from gpu_worker.snapshots import image_key_ids
                key = image_key_ids(ids, img["per_image"], img["digests"])
            restored = None
            if snaps is not None:
                try:
                    restored = snaps.lookup(key)
                except Exception as e:      # a snapshot that cannot be restored is a miss, never a failed request
                    log(f"snapshot lookup failed, computing in full: {type(e).__name__}: {e}")
            state = restored.state if restored is not None else self.model.new_state()
            cached = restored.n_tokens if restored is not None else 0
            pos = cached
            rows = None
            if img:
                rows = self._image_rows(img, cached)     # (embeddings, positions) of images not in the snapshot
            # Snapshots inside the prompt (e.g. where the last message ends, before the generation prompt that the
            # next turn renders differently): prefill up to each and keep a copy.
            keep_at = (msg.get("keep_at") or ()) if snaps is not None else ()
            for stop_at in sorted({int(k) for k in keep_at if cached < int(k) < len(ids)}):
                pos = self._prefill(ids, state, pos, stop_at, rows, cancel)
                if cancel.is_set():
                    break
                snaps.put(key[:stop_at], state)
            if rows is not None:
                # the image rows go in here; generate() gets only the last prompt token (never an image token)
                pos = self._prefill(ids, state, pos, len(ids) - 1, rows, cancel)
            self.chan.send({"op": "start", "id": rid, "cached_tokens": cached,
                            "snapshot": restored.source if restored is not None else None})
            p = msg["params"]
            params = SamplingParams(temperature=float(p.get("temperature", 0.0)), top_p=float(p.get("top_p", 1.0)),
                                    top_k=int(p.get("top_k", 0)), seed=p.get("seed"),
                                    max_tokens=int(p["max_tokens"]), min_tokens=int(p.get("min_tokens", 0)),
                                    stop_token_ids=tuple(int(t) for t in p.get("stop_token_ids", ())))
            acct = self.engine.accounting
            acct.per_token()        # folds the kernels' device-side counters in before the request
            a0 = (acct.tokens, acct.ms_waiting_for_disk, acct.ms_experts, acct.ms_waiting_for_router,
                  acct.ms_bookkeeping, acct.bytes_over_pcie)
            out: list[int] = []
            finish = None
            t_first = t_last = None
            disk_at_first = 0
            if not cancel.is_set():
                for step in generate(self.model, ids[pos:], params, state=state, prefill_budget=self.prefill_budget,
                                     max_span=self.prefill_chunk, cancel=cancel, logprobs=msg.get("logprobs")):
                    t_last = time.perf_counter()
                    if t_first is None:
                        t_first = t_last
                        disk_at_first = self._disk_bytes()
                    out.append(step.token)
                    finish = step.finish_reason
                    self.chan.send({"op": "token", "id": rid, "t": step.token, "f": step.finish_reason,
                                    "lp": step.logprob, "top": step.top_logprobs})
            if finish is None:
                finish = "cancelled"
            t_end = time.perf_counter()
            if snaps is not None and state.position > 0:
                full = key + out
                snaps.put(full[:state.position], state)
            n_decode = max(len(out) - 1, 0)
            prompt_ms = ((t_first or t_end) - t0) * 1e3
            decode_ms = ((t_last - t_first) * 1e3) if t_first is not None else 0.0
            disk_decode = (self._disk_bytes() - disk_at_first) if t_first is not None else 0
            acct.per_token()
            a1 = (acct.tokens, acct.ms_waiting_for_disk, acct.ms_experts, acct.ms_waiting_for_router,
                  acct.ms_bookkeeping, acct.bytes_over_pcie)
            d = [b - a for a, b in zip(a0, a1)]
            tot = self.totals
            tot["requests"] += 1
            tot["prompt_tokens"] += len(ids)
            tot["cached_tokens"] += cached
            tot["prefilled_tokens"] += len(ids) - cached
            tot["generated_tokens"] += len(out)
            tot["prefill_ms"] += prompt_ms
            tot["decode_ms"] += decode_ms
            tot["decode_tokens"] += n_decode
            tot["decode_disk_bytes"] += disk_decode
            self.chan.send({"op": "done", "id": rid, "finish_reason": finish,
                            "timings": {"cache_n": cached, "prompt_n": len(ids) - cached, "prompt_ms": prompt_ms,
                                        "predicted_n": len(out), "predicted_ms": decode_ms,
                                        "decode_steps": n_decode},
                            "engine": {"tokens": d[0], "ms_waiting_for_disk": d[1], "ms_experts": d[2],
                                       "ms_waiting_for_router": d[3], "ms_bookkeeping": d[4],
                                       "bytes_over_pcie": d[5],
                                       "bytes_from_disk_decode": disk_decode}})
        except Exception as e:
            log(f"request {rid} failed:\n{traceback.format_exc()}")
            self.chan.send({"op": "error", "id": rid, "message": f"{type(e).__name__}: {e}"})
        finally:
            with self._lock:
                self.current = None

    def _prefill(self, ids, state, pos: int, end: int, rows, cancel) -> int:
        """Feed ids[pos:end] (the state holds ids[:pos]) through the one prefill loop; `rows` = (embeddings
        [K, hidden], absolute positions [K]) of image tokens, whose embeddings replace the token embeddings.
        Returns the position reached: end, or 0 when cancelled (the state is then emptied)."""
        from gpu_worker.prefill import ImageRows, prefill
        prefill(self.model, ids, state, pos, end, images=ImageRows(*rows) if rows is not None else None,
                cancel=cancel, budget_bytes=self.prefill_budget, max_span=self.prefill_chunk)
        return state.position

    def _image_layout(self, img: dict, n_ids: int) -> dict:
        if self.vision is None:
            raise ValueError("images were sent but this model has no vision tower")
        grid = [tuple(int(v) for v in g) for g in img["grid_hw"]]
        positions = [int(p) for p in img["positions"]]
        counts = [gh * gw // 4 for gh, gw in grid]
        if sum(counts) != len(positions) or len(img["digests"]) != len(grid):
            raise ValueError(f"{len(positions)} image positions for images needing {sum(counts)}")
        if positions and (max(positions) >= n_ids - 1 or min(positions) < 0):
            raise ValueError("an image token is the last prompt token or outside the prompt")
        per_image, o = [], 0
        for c in counts:
            per_image.append(positions[o:o + c])
            o += c
        pv = torch.frombuffer(bytearray(img["pixel_values"]), dtype=torch.float32).reshape(
            int(img["n_rows"]), int(img["row_size"]))
        return {"grid": grid, "per_image": per_image, "digests": list(img["digests"]), "pixel_values": pv}

    def _image_rows(self, img: dict, cached: int):
        """Runs the tower on the images that have a token at or after `cached` (the others are in the snapshot)."""
        pv, grid = img["pixel_values"], img["grid"]
        starts, r = [], 0
        for gh, gw in grid:
            starts.append(r)
            r += gh * gw
        need = [i for i, pos in enumerate(img["per_image"]) if pos and pos[-1] >= cached]
        if not need:
            return None
        sub_pv = torch.cat([pv[starts[i]:starts[i] + grid[i][0] * grid[i][1]] for i in need])
        sub_grid = torch.tensor([grid[i] for i in need], dtype=torch.long)
        with torch.inference_mode():
            emb = torch.cat(list(self.vision(sub_pv, sub_grid)))
        at = torch.tensor([p for i in need for p in img["per_image"][i]], dtype=torch.long)
        return emb, at

    def stats(self) -> dict:
        acct = self.engine.accounting
        out = {"totals": dict(self.totals), "accounting": acct.per_token(),
               "accounting_totals": {"tokens": acct.tokens, "ms_waiting_for_disk": acct.ms_waiting_for_disk,
                                     "ms_experts": acct.ms_experts, "ms_waiting_for_router": acct.ms_waiting_for_router,
                                     "ms_bookkeeping": acct.ms_bookkeeping,
                                     "bytes_over_pcie": acct.bytes_over_pcie, "hits_at_lookup": acct.hits_at_lookup,
                                     "misses_at_lookup": acct.misses_at_lookup},
               "prefill": self.engine.experts.prefill_acct.totals()}
        try:
            cs = self.engine.cache_stats()
            out["cache"] = {k: v for k, v in cs.items() if isinstance(v, (int, float))}
        except Exception as e:
            out["cache"] = {"error": str(e)}
        if self.snaps is not None:
            out["snapshots"] = self.snaps.info()
        return out


def load_vision(model_dir, device, dtype, chan=None):
    """(tower, device bytes to keep free for its activations) for an Omni / VL checkpoint, else (None, 0).

    On a GPU the tower's weights stay in pinned host memory and stream to two device slots block by block
    (`gpu_worker.weight_stream`); on the CPU they are used in place."""
    if not model_dir:
        return None, 0
    from nemotron.checkpoint import Checkpoint
    ckpt = Checkpoint(model_dir)
    mm = ckpt.config.multimodal
    if mm is None or not mm.get("vision_config"):
        return None, 0
    from nemotron.vision import VisionTower
    from nemotron.vision_preprocess import TILED, ImageGeometry
    if chan is not None:
        chan.send({"op": "status", "message": "loading the vision tower"})
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
    return tower, tower.activation_bytes(most) if cuda else 0


def _die_with_parent() -> None:
    """The launcher's death ends this process too (the socket's EOF does as well; this covers a stuck read)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)     # PR_SET_PDEATHSIG
    except OSError:
        pass


def main(argv=None) -> int:
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
    ap.add_argument("--snapshot-dir")
    ap.add_argument("--snapshot-count", type=int, default=32)
    ap.add_argument("--snapshot-ram-bytes", type=int, default=2 << 30)
    ap.add_argument("--snapshot-disk-count", type=int, default=64)
    a = ap.parse_args(argv)
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # the launcher decides when we stop
    chan = Channel(socket.socket(fileno=a.fd))
    if a.threads:
        torch.set_num_threads(a.threads)
    chan.send({"op": "status", "message": "starting the cache processes and loading the dense weights"})
    from gpu_worker.engine import StreamingEngine
    from gpu_worker.snapshots import SnapshotStore, model_key
    dtype = DTYPES[a.dtype]
    try:
        # the tower first: its device slots then count as used when the VRAM tier is sized from the budget
        vision, vision_reserve = load_vision(a.model, a.device, dtype, chan)
        reserve = (512 << 20) + vision_reserve
        engine = StreamingEngine(a.store, cache_bytes=a.cache_bytes, io_workers=a.io_workers, device=a.device,
                                 dtype=dtype, model_dir=a.model, vram_reserve_bytes=reserve,
                                 vram_bytes=a.vram_bytes if str(a.device).startswith("cuda") else None)
    except Exception as e:
        log(traceback.format_exc())
        chan.send({"op": "fatal", "message": f"loading {a.store} failed: {type(e).__name__}: {e}"})
        return 2
    snaps = None
    try:
        m = engine.store.manifest
        key = model_key(m["config_hash"], m.get("checkpoint_fingerprint", ""), dtype, a.device)
        snaps = SnapshotStore(key, engine.model.new_state, a.device, max_count=a.snapshot_count,
                              max_bytes=a.snapshot_ram_bytes, directory=a.snapshot_dir,
                              max_disk_count=a.snapshot_disk_count, log=log)
        c = engine.model.config
        chan.send({"op": "ready", "info": {
            "pid": os.getpid(), "device": a.device, "dtype": a.dtype, "vocab_size": c.vocab_size,
            "eos_token_ids": list(c.eos_token_ids), "model_key": key, "cache_prefix": engine.sup.prefix,
            "cache_child_pids": engine.sup.child_pids(), "snapshots_on_disk": len(snaps.disk)}})
        Worker(engine, chan, snaps, a.prefill_chunk, vision).serve()
    finally:
        if snaps is not None:
            snaps.close()
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
