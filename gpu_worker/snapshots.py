"""Conversation snapshots: the model state after a token prefix, kept so a later request that extends the
prefix prefills only its tail.

A snapshot is an `InferenceState` (Mamba conv and SSM states, KV caches, position) plus the exact token ids it
has consumed. Mamba state cannot be rolled back, so a snapshot is usable only when its ids are a prefix of the
new prompt, token for token (not text); the longest such snapshot wins. Snapshots live in host RAM (an LRU
bounded by count and bytes) and, with a directory, also on disk:

    file = MAGIC (8 bytes) | header length (u32 LE) | msgpack header | payload (torch.save of the state)
    header = {format, version, model_key, n_tokens, ids (int32 LE bytes), payload_bytes, payload_sha256}

File names are a hash of the model key and the ids, never text from a request. The files hold the
conversation (their headers decode to the prompt), so they are created 0600 in a 0700 directory, private from
the first byte (the mode is given to open and mkdir, not set afterwards). A write goes to `NAME.tmp<pid>`
first and is renamed into place; a failed write (a full disk) removes its temporary file, and temporary files
of processes that are gone are swept at start.

The model key covers the store's config hash and checkpoint fingerprint, the compute dtype and the device type,
so a snapshot from another model, precision or device is a miss. A truncated, corrupted or mismatched file is a
miss (and a damaged one is removed), never a crash or a wrong answer: the payload's sha256 is checked before
loading and the tensors' shapes against a fresh state of the model.
"""
from __future__ import annotations

import hashlib
import io
import os
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np
import torch

from cache_shm.names import pid_alive
from nemotron.model import InferenceState

MAGIC = b"MSSNAP\x00\x01"
FORMAT = "moestream-snapshot"
VERSION = 1
SUFFIX = ".snap"


def model_key(config_hash: str, checkpoint_fingerprint: str, dtype: torch.dtype, device) -> str:
    raw = f"{FORMAT}/{VERSION}/{config_hash}/{checkpoint_fingerprint}/{dtype}/{torch.device(device).type}"
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def image_key_ids(ids: list[int], positions_per_image, digests) -> list[int]:
    """The snapshot key of a prompt with images: its token ids with each image token replaced by a negative
    number drawn from the image's digest and the token's index inside the image. Image tokens are placeholders
    (the same id for every image), so without this two prompts with the same text and different images would
    share snapshots; with it, a key prefix matches only where the same image sits at the same positions.
    Each entry carries 31 bits of sha256(digest, index); real token ids are never negative."""
    key = list(ids)
    for pos, dg in zip(positions_per_image, digests):
        d = bytes.fromhex(dg) if isinstance(dg, str) else bytes(dg)
        for k, p in enumerate(pos):
            h = hashlib.sha256(d + int(k).to_bytes(4, "little")).digest()
            key[int(p)] = -1 - (int.from_bytes(h[:4], "little") & 0x7FFFFFFF)
    return key


# ------------------------------------------------------------------------------------------ host copies
# The states copy themselves to and from the host (`InferenceState.to_host` / `from_host`); a payload is that
# dict as torch.save writes it.
def check_compatible(d: dict, template: InferenceState, n_tokens: int) -> str | None:
    """Why the host copy `d` cannot be restored into a model whose fresh state is `template` after exactly
    `n_tokens` tokens (None: it can)."""
    if not isinstance(d, dict) or d.get("position") != n_tokens:
        return f"position {d.get('position') if isinstance(d, dict) else '?'} != {n_tokens} tokens"
    return template.host_mismatch(d)


def state_bytes(d: dict) -> int:
    n = 0
    for s in d["layers"]:
        if s is not None:
            n += sum(v.numel() * v.element_size() for v in s.values() if torch.is_tensor(v))
    return n


# ------------------------------------------------------------------------------------------ files
class SnapshotFileError(Exception):
    pass


def encode_file(key: str, ids: list[int], d: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(d, buf)
    payload = buf.getvalue()
    header = msgpack.packb({"format": FORMAT, "version": VERSION, "model_key": key, "n_tokens": len(ids),
                            "ids": np.asarray(ids, dtype="<i4").tobytes(), "payload_bytes": len(payload),
                            "payload_sha256": hashlib.sha256(payload).hexdigest()})
    return MAGIC + struct.pack("<I", len(header)) + header + payload


def read_header(path: Path, key: str) -> tuple[dict, list[int], int]:
    """(header, ids, payload offset); raises SnapshotFileError for anything but a well-formed file of `key`."""
    try:
        with open(path, "rb") as f:
            head = f.read(12)
            if len(head) < 12 or head[:8] != MAGIC:
                raise SnapshotFileError("not a snapshot file (bad magic)")
            (n,) = struct.unpack("<I", head[8:])
            if n > (64 << 20):
                raise SnapshotFileError("header too large")
            raw = f.read(n)
            if len(raw) != n:
                raise SnapshotFileError("truncated header")
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise SnapshotFileError(str(e)) from e
    try:
        h = msgpack.unpackb(raw)
    except Exception as e:
        raise SnapshotFileError(f"unreadable header ({e})") from e
    if not isinstance(h, dict) or h.get("format") != FORMAT or h.get("version") != VERSION:
        raise SnapshotFileError(f"format/version mismatch ({h.get('format') if isinstance(h, dict) else '?'})")
    if h.get("model_key") != key:
        raise SnapshotFileError("made by another model, precision or device")
    ids_raw = h.get("ids")
    if not isinstance(ids_raw, bytes) or len(ids_raw) != 4 * int(h.get("n_tokens", -1)):
        raise SnapshotFileError("bad token list")
    if size != 12 + n + int(h.get("payload_bytes", -1)):
        raise SnapshotFileError(f"truncated or padded: {size} bytes on disk")
    return h, np.frombuffer(ids_raw, dtype="<i4").tolist(), 12 + n


def read_payload(path: Path, h: dict, offset: int) -> dict:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            payload = f.read()
    except OSError as e:
        raise SnapshotFileError(str(e)) from e
    if len(payload) != h["payload_bytes"] or hashlib.sha256(payload).hexdigest() != h["payload_sha256"]:
        raise SnapshotFileError("payload checksum mismatch")
    try:
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:
        raise SnapshotFileError(f"payload does not load ({e})") from e


# ------------------------------------------------------------------------------------------ the store
@dataclass
class _Entry:
    ids: tuple
    state: dict | None          # host-side tensors (None: on disk only)
    nbytes: int
    path: Path | None = None


@dataclass
class Restored:
    state: InferenceState
    n_tokens: int
    source: str                 # 'ram' | 'disk'


class SnapshotStore:
    def __init__(self, key: str, template_fn, device, max_count: int = 32, max_bytes: int = 2 << 30,
                 directory=None, max_disk_count: int = 64, log=None):
        """template_fn() -> a fresh InferenceState of the model (to check shapes); device: the model's."""
        self.key, self.template_fn, self.device = key, template_fn, torch.device(device)
        self.max_count, self.max_bytes = max_count, max_bytes
        self.dir = Path(directory) if directory else None
        self.max_disk_count = max_disk_count
        self.log = log or (lambda m: None)
        self.ram: OrderedDict[tuple, _Entry] = OrderedDict()     # LRU: oldest first
        self.disk: dict[tuple, Path] = {}
        self.stats = {"hits_ram": 0, "hits_disk": 0, "misses": 0, "bad_files": 0, "written": 0, "evicted": 0}
        self._lock = threading.Lock()
        self._writer: threading.Thread | None = None
        self._pending: list = []
        self._writing = 0
        self._wake = threading.Condition(self._lock)
        self._closing = False
        if self.dir is not None:
            _private_dir(self.dir, self.log)
            self._sweep_tmp()
            self._scan()
            self._writer = threading.Thread(target=self._write_loop, name="snapshot-writer", daemon=True)
            self._writer.start()

    # ---- RAM ----------------------------------------------------------------------------------
    @property
    def ram_bytes(self) -> int:
        return sum(e.nbytes for e in self.ram.values())

    def put(self, ids: list[int], state: InferenceState) -> None:
        """Keep a copy of `state` (which has consumed exactly `ids`) in host RAM, and on disk with a directory."""
        if not ids or state.position != len(ids):
            return
        self.put_host(ids, state.to_host())

    def put_host(self, ids: list[int], d: dict) -> None:
        """`put` for a state already in host memory (`InferenceState.to_host`'s layout, e.g. one that the prefill
        captured inside a prompt: gpu_worker/prefill.py `capture_at`), which has consumed exactly `ids`."""
        if not ids or d.get("position") != len(ids):
            return
        n = state_bytes(d)
        if n > self.max_bytes or self.max_count <= 0:
            return
        k = tuple(ids)
        with self._lock:
            self.ram.pop(k, None)
            self.ram[k] = _Entry(k, d, n)
            while len(self.ram) > self.max_count or self.ram_bytes > self.max_bytes:
                self.ram.popitem(last=False)
                self.stats["evicted"] += 1
            if self.dir is not None and k not in self.disk:
                self._pending.append((k, d))
                self._wake.notify_all()

    def settled(self, timeout: float = 30.0) -> bool:
        """Wait until every kept state is written (tests, benches); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending or self._writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(left)
        return True

    def lookup(self, ids: list[int]) -> Restored | None:
        """The longest kept snapshot whose ids are a proper prefix of `ids`, restored onto the model's device
        (a copy: the kept one stays intact). None when nothing matches."""
        n_ids = len(ids)
        with self._lock:
            cands = [(len(k), "ram", k) for k in self.ram if len(k) < n_ids and list(k) == ids[:len(k)]]
            cands += [(len(k), "disk", k) for k in self.disk
                      if k not in self.ram and len(k) < n_ids and list(k) == ids[:len(k)]]
        for n, where, k in sorted(cands, reverse=True):
            if where == "ram":
                with self._lock:
                    e = self.ram.get(k)
                    if e is None:
                        continue
                    self.ram.move_to_end(k)
                    self.stats["hits_ram"] += 1
                return Restored(InferenceState.from_host(e.state, self.device), n, "ram")
            d = self._load(k)
            if d is None:
                continue
            with self._lock:
                self.ram[k] = _Entry(k, d, state_bytes(d))
                while len(self.ram) > self.max_count or self.ram_bytes > self.max_bytes:
                    self.ram.popitem(last=False)
                self.stats["hits_disk"] += 1
            return Restored(InferenceState.from_host(d, self.device), n, "disk")
        self.stats["misses"] += 1
        return None

    # ---- disk ---------------------------------------------------------------------------------
    def path_for(self, ids) -> Path:
        h = hashlib.sha256(self.key.encode() + np.asarray(ids, dtype="<i4").tobytes()).hexdigest()[:40]
        return self.dir / f"{h}{SUFFIX}"

    def _bad(self, path: Path, why: str) -> None:
        self.stats["bad_files"] += 1
        self.log(f"snapshots: ignoring {path.name}: {why}")

    def _scan(self) -> None:
        for p in sorted(self.dir.glob(f"*{SUFFIX}")):
            try:
                _, ids, _ = read_header(p, self.key)
            except SnapshotFileError as e:
                self._bad(p, str(e))
                if "another model" not in str(e):
                    _remove(p)
                continue
            if ids and p == self.path_for(ids):
                self.disk[tuple(ids)] = p
            else:
                self._bad(p, "name does not match its contents")
        if self.disk:
            self.log(f"snapshots: {len(self.disk)} on disk in {self.dir}")

    def _load(self, k: tuple) -> dict | None:
        p = self.disk.get(k)
        if p is None:
            return None
        try:
            h, ids, off = read_header(p, self.key)
            if tuple(ids) != k:
                raise SnapshotFileError("token list changed on disk")
            d = read_payload(p, h, off)
            why = check_compatible(d, self.template_fn(), len(k))
            if why:
                raise SnapshotFileError(why)
            return d
        except SnapshotFileError as e:
            self._bad(p, str(e))
            with self._lock:
                self.disk.pop(k, None)
            _remove(p)
            return None

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._closing:
                    self._wake.wait()
                if not self._pending:    # closing with nothing left (what was queued before close() is written)
                    return
                k, d = self._pending.pop(0)
                self._writing += 1
            try:
                p = self.path_for(k)
                _write_private(p, encode_file(self.key, list(k), d))
                with self._lock:
                    self.disk[k] = p
                    self.stats["written"] += 1
                self._trim_disk()
            except OSError as e:
                self.log(f"snapshots: could not write to {self.dir}: {e}")
            finally:
                k = d = None             # the written state is not held by this frame until the next write
                with self._lock:
                    self._writing -= 1
                    self._wake.notify_all()

    def _sweep_tmp(self) -> None:
        """Temporary files left by a process that died mid-write (a kill, a crash) are never renamed: remove
        them. Those of a live process (another server sharing the directory) are its writes in progress."""
        for t in self.dir.glob("*.tmp[0-9]*"):
            pid = t.name.rsplit(".tmp", 1)[-1]
            if not pid.isdigit() or not pid_alive(int(pid)) or int(pid) == os.getpid():
                self.log(f"snapshots: removing {t.name}, left by an unfinished write")
                _remove(t)

    def _trim_disk(self) -> None:
        with self._lock:
            if len(self.disk) <= self.max_disk_count:
                return
            by_age = sorted(self.disk.items(), key=lambda kv: _mtime(kv[1]))
            drop = by_age[:len(self.disk) - self.max_disk_count]
            for k, _ in drop:
                del self.disk[k]
        for _, p in drop:
            _remove(p)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every pending disk write is done."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending and not self._writing:
                    break
            time.sleep(0.01)

    def close(self, timeout: float = 30.0) -> None:
        with self._lock:
            self._closing = True
            self._wake.notify_all()
        if self._writer is not None:
            self._writer.join(timeout)
        self._writer = None

    def info(self) -> dict:
        with self._lock:
            return dict(self.stats, in_ram=len(self.ram), ram_bytes=self.ram_bytes, on_disk=len(self.disk))


def _private_dir(d: Path, log) -> None:
    d.parent.mkdir(parents=True, exist_ok=True)
    try:
        d.mkdir(mode=0o700)
    except FileExistsError:
        mode = d.stat().st_mode & 0o777
        if mode & 0o077:
            log(f"snapshots: {d} was mode {mode:03o}; making it 0700 (the files hold conversations)")
            d.chmod(0o700)


def _write_private(p: Path, data: bytes) -> None:
    """`data` into `p`, atomically (a temporary file renamed), created 0600; on any failure the temporary file is
    removed and the error raised."""
    tmp = p.with_name(f"{p.name}.tmp{os.getpid()}")
    _remove(tmp)        # O_EXCL: a file already there (its mode unknown) is never reused
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, p)
    except BaseException:
        _remove(tmp)
        raise


def _remove(p: Path) -> None:
    try:
        p.unlink()
    except OSError:
        pass


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0
