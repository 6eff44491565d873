"""expert_store writer + verify and the tools.repack command line: round trips on synth checkpoints, must-fail twins, kill-and-resume, ENOSPC, refusals."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from expert_store import source
from expert_store.format import (DENSE_NAME, EXPERTS_NAME, JOURNAL_NAME, MANIFEST_NAME, MTP_NAME, RepackError,
                                 StoreError, VerifyError, read_manifest, write_manifest)
from expert_store.layout import block_crc, raw_bytes
from expert_store.reader import ExpertStore
from expert_store.source import EXPERT_RE
from expert_store.verify import verify
from expert_store.writer import repack
from kernels.nvfp4 import decode_nvfp4, encode_fp8
from nemotron.checkpoint import Checkpoint
from tools import repack as cli
from tools.synth import synthesize

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Tiny synth checkpoints in every quant mode, plus an FP8-expert one (rewritten from bf16) with an mtp tensor."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for q in ("nvfp4", "mixed", "bf16"):
        synthesize(root / q, preset="tiny", quant=q, seed=1)
        out[q] = root / q

    def to_fp8(tensors):
        new = {}
        for n, t in tensors.items():
            if EXPERT_RE.match(n):
                w, s = encode_fp8(t.float())
                new[n], new[n[:-len("weight")] + "weight_scale"] = w, s
            else:
                new[n] = t
        new["mtp.layers.0.enorm.weight"] = torch.ones(8, dtype=torch.bfloat16)
        return new
    out["fp8"] = rewrite(out["bf16"], root / "fp8", to_fp8)
    return out


def rewrite(src: Path, dst: Path, fn) -> Path:
    """Copy a checkpoint, passing its tensors through fn(dict) -> dict; written as two shards + index."""
    ck = Checkpoint(src)
    tensors = fn({n: ck.get(n) for n in ck.tensor_names()})
    dst.mkdir(parents=True)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    wm = {}
    for fname, ns in shards.items():
        save_file({n: tensors[n].contiguous() for n in ns}, str(dst / fname))
        wm.update({n: fname for n in ns})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


@pytest.fixture(scope="module")
def stores(ckpts, tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    out = {}
    for q, ck in ckpts.items():
        repack(ck, root / q, workers=2, progress=False)
        out[q] = root / q
    return out


def copy_store(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "store"
    shutil.copytree(src, dst)
    return dst


def flip_byte(path: Path, offset: int, mask: int = 0x01):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ mask]))


def rewrite_arrays(store_dir: Path, fn):
    """Edit blocks.npz and keep the manifest consistent (what an attacker or a bug with a matching crc would do)."""
    m, arrays = read_manifest(store_dir)
    fn(arrays)
    m = {k: v for k, v in m.items() if k not in ("blocks_file", "blocks_crc32")}
    write_manifest(store_dir, m, arrays)


# ------------------------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("quant", ["nvfp4", "mixed", "bf16", "fp8"])
def test_round_trip(quant, ckpts, stores):
    ck_dir, store_dir = ckpts[quant], stores[quant]
    r = verify(store_dir, ck_dir, progress=False)
    ck = Checkpoint(ck_dir)
    cfg = ck.config
    assert r.blocks_checked == len(cfg.moe_layers) * cfg.n_routed_experts
    s = ExpertStore.open(store_dir, expected_config_hash=cfg.config_hash())
    kind = {"nvfp4": "nvfp4", "mixed": "nvfp4", "bf16": "bf16", "fp8": "fp8"}[quant]
    assert s.geometry.fmt == kind and (s.geometry.L, s.geometry.I) == (64, 96)
    assert s.moe_layers == cfg.moe_layers and s.n_experts == cfg.n_routed_experts
    assert (np.diff(s.offsets.reshape(-1)) == s.block_stride).all() and (s.offsets % 4096 == 0).all()
    for j, layer in enumerate(s.moe_layers):
        for e in range(s.n_experts):
            up, down = s.unpack_block(s.read_block(j, e), j, e)
            for proj, w in (("up", up), ("down", down)):
                mod = ck.expert_module(layer, e, proj)
                for field, name in (("weight", ".weight"), ("weight_scale", ".weight_scale"),
                                    ("weight_scale_2", ".weight_scale_2")):
                    t = getattr(w, field)
                    if not ck.has(mod + name):
                        assert t is None or field == "weight_scale" and kind == "fp8"
                        continue
                    want = ck.get(mod + name)
                    assert t.dtype == want.dtype and t.shape == want.shape, (mod + name, t.shape, want.shape)
                    assert raw_bytes(t).tobytes() == raw_bytes(want).tobytes(), mod + name
            if kind == "nvfp4" and e % 7 == 0:
                want = decode_nvfp4(ck.get(mod + ".weight"), ck.get(mod + ".weight_scale"),
                                    ck.get(mod + ".weight_scale_2"))
                assert torch.equal(down.dequantize(), want)
    # the dense file holds every other tensor, verbatim
    with safe_open(store_dir / DENSE_NAME, "pt") as f:
        dense = set(f.keys())
    assert dense == {n for n in ck.tensor_names() if not EXPERT_RE.match(n) and not n.startswith("mtp.")}
    assert (store_dir / MTP_NAME).exists() == (quant == "fp8")
    # the store directory is itself a checkpoint of the dense part (config, tokenizer, index -> dense files)
    view = Checkpoint(store_dir)
    assert view.config.config_hash() == cfg.config_hash()
    assert set(view.tensor_names()) == {n for n in ck.tensor_names() if not EXPERT_RE.match(n)}
    for name in sorted(dense)[::10]:
        a, b = view.get(name), ck.get(name)
        assert a.dtype == b.dtype and a.shape == b.shape and raw_bytes(a).tobytes() == raw_bytes(b).tobytes()
    if quant != "fp8":
        assert (store_dir / "tokenizer.json").read_bytes() == (ck_dir / "tokenizer.json").read_bytes()
    assert not (store_dir / JOURNAL_NAME).exists()


def test_rerun_on_complete_store_is_a_no_op(ckpts, stores, tmp_path):
    d = copy_store(stores["nvfp4"], tmp_path)
    before = (d / EXPERTS_NAME).stat().st_mtime_ns
    r = repack(ckpts["nvfp4"], d, progress=False)
    assert r.already_complete and (d / EXPERTS_NAME).stat().st_mtime_ns == before


def test_cli_repack_and_verify(ckpts, tmp_path, capsys):
    out = tmp_path / "s"
    assert cli.main(["--model", str(ckpts["mixed"]), "--out", str(out), "--no-progress", "--workers", "3"]) == 0
    assert cli.main(["--verify", str(out), "--model", str(ckpts["mixed"]), "--no-progress", "--sample", "5"]) == 0
    assert "OK: 5 blocks" in capsys.readouterr().out


def test_dense_sharding(ckpts, tmp_path):
    d = tmp_path / "s"
    repack(ckpts["bf16"], d, progress=False, dense_shard_bytes=300_000)
    files = ExpertStore.open(d).dense_files
    assert len(files) > 1 and files[0].name == f"dense-00001-of-{len(files):05d}.safetensors"
    assert verify(d, ckpts["bf16"], progress=False).dense_tensors_checked == \
        json.loads((d / MANIFEST_NAME).read_text())["dense_tensors"]


# ------------------------------------------------------------------------------------------ must-fail twins
def test_flipped_byte_fails_verification(ckpts, stores, tmp_path, capsys):
    d = copy_store(stores["nvfp4"], tmp_path)
    s = ExpertStore.open(d)
    byte = s.geometry.down_groups.offset + 2 * s.geometry.group_bytes + 5
    flip_byte(s.experts_path, int(s.offsets[2, 5]) + byte)
    with pytest.raises(VerifyError) as ei:
        verify(d, ckpts["nvfp4"], progress=False)
    msg = str(ei.value)
    assert "moe layer 2 = model layer 7, expert 5" in msg and "section down_groups" in msg
    assert f"byte {byte:,} of the block" in msg
    # byte 5 of group 2 = row 0, bytes 16..23 of down_proj.weight's row: byte [0, 21]
    assert "group 2: backbone.layers.7.mixer.experts.5.down_proj.weight byte [0, 21]" in msg
    assert cli.main(["--verify", str(d), "--model", str(ckpts["nvfp4"]), "--no-progress"]) == 1
    assert "section down_groups" in capsys.readouterr().err
    # the checksum alone catches it too, and so does the decode when the checksum was "fixed"
    with pytest.raises(StoreError, match="checksum mismatch"):
        s.read_block(2, 5)
    rewrite_arrays(d, lambda a: a["checksums"].__setitem__((2, 5), block_crc(s.read_block(2, 5, False),
                                                                                    s.geometry)))
    with pytest.raises(VerifyError, match="section down_groups"):
        verify(d, ckpts["nvfp4"], progress=False)


def test_block_of_another_expert_is_detected(ckpts, stores, tmp_path):
    d = copy_store(stores["mixed"], tmp_path)
    s = ExpertStore.open(d)
    a, b = s.read_block(1, 3), s.read_block(1, 4)
    with open(s.experts_path, "r+b") as f:
        os.pwrite(f.fileno(), b.tobytes(), int(s.offsets[1, 3]))
        os.pwrite(f.fileno(), a.tobytes(), int(s.offsets[1, 4]))
    with pytest.raises(VerifyError, match=r"expert 3\).*section up_values"):
        verify(d, ckpts["mixed"], progress=False)

    def swap(arr):
        c = arr["checksums"]
        c[1, 3], c[1, 4] = c[1, 4], c[1, 3]
    rewrite_arrays(d, swap)       # checksums moved with the blocks: only the decode can tell
    ExpertStore.open(d).read_block(1, 3)
    with pytest.raises(VerifyError, match=r"expert 3\).*section up_values"):
        verify(d, ckpts["mixed"], progress=False)


def test_wrong_global_is_detected(ckpts, stores, tmp_path):
    d = copy_store(stores["nvfp4"], tmp_path)
    rewrite_arrays(d, lambda a: a["down_global"].__setitem__((0, 1), a["down_global"][0, 1] * 2))
    with pytest.raises(VerifyError, match=r"expert 1\).*down_global"):
        verify(d, ckpts["nvfp4"], progress=False)


def test_truncated_experts_file(ckpts, stores, tmp_path):
    d = copy_store(stores["nvfp4"], tmp_path)
    s = ExpertStore.open(d)
    os.truncate(s.experts_path, int(s.offsets[3, 10]) + 100)
    with pytest.raises(VerifyError, match=r"experts.bin: truncated.*moe layer 3 = model layer 10, expert 10"):
        verify(d, ckpts["nvfp4"], progress=False)
    with pytest.raises(RepackError, match="damaged"):
        repack(ckpts["nvfp4"], d, progress=False)


# ------------------------------------------------------------------------------------------ kill and resume
class Abort(Exception):
    pass


def test_abort_and_resume(ckpts, tmp_path):
    d = tmp_path / "s"

    def abort_after_two(j, e0, e1, seen=[]):
        seen.append(j)
        if len(seen) == 2:
            raise Abort
    with pytest.raises(Abort):
        repack(ckpts["nvfp4"], d, workers=1, progress=False, on_range_done=abort_after_two)
    assert not (d / MANIFEST_NAME).exists()
    with pytest.raises(StoreError, match="incomplete store"):
        ExpertStore.open(d)
    with open(d / JOURNAL_NAME, "a") as f:
        f.write('{"j": 3, "e0": 0, "crc": [1, 2')          # a record torn by the kill
    r = repack(ckpts["nvfp4"], d, workers=2, progress=False)
    assert 2 * 32 <= r.resumed_blocks < 4 * 32 and not r.already_complete
    assert r.bytes_written < (d / EXPERTS_NAME).stat().st_size
    verify(d, ckpts["nvfp4"], progress=False)


def test_resume_in_ranges_of_experts(ckpts, tmp_path, monkeypatch):
    d = tmp_path / "s"
    monkeypatch.setattr(source, "RANGE_BYTES", 5 * 8192)      # ranges of 5 experts: 7 per layer of 32

    def abort_at_third(j, e0, e1, seen=[]):
        seen.append((j, e0, e1))
        if len(seen) == 3:
            raise Abort
    with pytest.raises(Abort):
        repack(ckpts["nvfp4"], d, workers=1, progress=False, on_range_done=abort_at_third)
    monkeypatch.setattr(source, "RANGE_BYTES", 256 << 20)     # the journal's range size wins on resume
    r = repack(ckpts["nvfp4"], d, workers=2, progress=False)
    assert r.resumed_blocks == 15
    verify(d, ckpts["nvfp4"], progress=False)


def test_sigkill_and_resume(ckpts, tmp_path):
    d = tmp_path / "s"
    code = ("import sys, time; from expert_store.writer import repack\n"
            "def hold(j, e0, e1):\n    print('layer', j, flush=True); time.sleep(60)\n"
            f"repack({str(ckpts['mixed'])!r}, {str(d)!r}, workers=1, progress=False, on_range_done=hold)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("layer"), line
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    assert not (d / MANIFEST_NAME).exists() and (d / JOURNAL_NAME).exists()
    r = repack(ckpts["mixed"], d, workers=2, progress=False)
    assert r.resumed_blocks >= 32
    verify(d, ckpts["mixed"], progress=False)


# ------------------------------------------------------------------------------------------ ENOSPC
def test_enospc_mid_repack_then_resume(ckpts, tmp_path, monkeypatch):
    d = tmp_path / "s"
    real = os.pwrite
    calls = [0]

    def full_disk(fd, data, offset):
        calls[0] += 1
        if calls[0] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)
    monkeypatch.setattr(os, "pwrite", full_disk)
    with pytest.raises(RepackError, match=r"disk full \(ENOSPC\).*NOT complete"):
        repack(ckpts["nvfp4"], d, workers=1, progress=False)
    assert not (d / MANIFEST_NAME).exists()
    monkeypatch.setattr(os, "pwrite", real)
    repack(ckpts["nvfp4"], d, progress=False)
    verify(d, ckpts["nvfp4"], progress=False)


@pytest.mark.parametrize("where", ["fdatasync", "fsync", "write"])
def test_enospc_at_sync_journal_or_manifest(where, ckpts, tmp_path, monkeypatch):
    d = tmp_path / "s"
    real = getattr(os, where)
    calls = [0]

    def failing(fd, *a):        # the journal's first append (write), or the 3rd sync: mid-repack
        calls[0] += 1
        if where == "write" or calls[0] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, *a)
    monkeypatch.setattr(os, where, failing)
    with pytest.raises(RepackError, match="NOT complete"):
        repack(ckpts["bf16"], d, workers=1, progress=False)
    assert not (d / MANIFEST_NAME).exists()
    monkeypatch.setattr(os, where, real)
    repack(ckpts["bf16"], d, progress=False)
    verify(d, ckpts["bf16"], progress=False)


def test_short_writes_are_completed(ckpts, tmp_path, monkeypatch):
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, off: real(fd, bytes(memoryview(data)[:1000]), off))
    repack(ckpts["nvfp4"], tmp_path / "s", progress=False)
    monkeypatch.setattr(os, "pwrite", real)
    verify(tmp_path / "s", ckpts["nvfp4"], progress=False)


def test_enospc_on_a_small_tmpfs(ckpts, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a size-limited tmpfs here")
    try:
        with pytest.raises(RepackError, match="ENOSPC ahead"):
            repack(ckpts["nvfp4"], mnt / "s", progress=False)
        assert not (mnt / "s" / MANIFEST_NAME).exists()
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


# ------------------------------------------------------------------------------------------ refusals
def test_refuses_another_models_store(ckpts, stores, tmp_path):
    other = tmp_path / "other"
    synthesize(other, preset="tiny", quant="nvfp4", seed=1, experts=16)
    h_other = Checkpoint(other).config.config_hash()
    h_store = json.loads((stores["nvfp4"] / MANIFEST_NAME).read_text())["config_hash"]
    d = copy_store(stores["nvfp4"], tmp_path)
    with pytest.raises(RepackError, match=f"another model.*{h_store}.*{h_other}"):
        repack(other, d, progress=False)
    with pytest.raises(VerifyError, match=f"{h_store}.*{h_other}"):
        verify(d, other, progress=False)
    # an unfinished repack of another model is not continued either
    partial = tmp_path / "partial"
    with pytest.raises(Abort):
        repack(ckpts["nvfp4"], partial, workers=1, progress=False,
                  on_range_done=lambda *a: (_ for _ in ()).throw(Abort))
    with pytest.raises(RepackError, match=f"unfinished repack of another model.*{h_store}.*{h_other}"):
        repack(other, partial, progress=False)


def test_refuses_another_checkpoint_of_the_same_config(ckpts, stores, tmp_path):
    other = tmp_path / "other"
    synthesize(other, preset="tiny", quant="nvfp4", seed=2)        # same config, other weights
    assert Checkpoint(other).config.config_hash() == Checkpoint(ckpts["nvfp4"]).config.config_hash()
    d = copy_store(stores["nvfp4"], tmp_path)
    with pytest.raises(RepackError, match="another checkpoint with the same config"):
        repack(other, d, progress=False)
    with pytest.raises(VerifyError, match="MISMATCH"):
        verify(d, other, progress=False, sample=3)
    partial = tmp_path / "partial"
    with pytest.raises(Abort):
        repack(ckpts["nvfp4"], partial, workers=1, progress=False,
                  on_range_done=lambda *a: (_ for _ in ()).throw(Abort))
    with pytest.raises(RepackError, match="refusing to mix"):
        repack(other, partial, progress=False)


def test_refuses_another_format_version(ckpts, stores, tmp_path):
    d = copy_store(stores["nvfp4"], tmp_path)
    p = d / MANIFEST_NAME
    m = json.loads(p.read_text())
    m["format_version"] = 99
    p.write_text(json.dumps(m))
    with pytest.raises(RepackError, match="version 99"):
        repack(ckpts["nvfp4"], d, progress=False)
    with pytest.raises(StoreError, match="format version 99"):
        ExpertStore.open(d)


def test_refuses_a_non_store_directory(ckpts, tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "notes.txt").write_text("mine")
    with pytest.raises(RepackError, match="not empty and not an expert store"):
        repack(ckpts["nvfp4"], tmp_path / "s", progress=False)


def test_missing_and_misshaped_expert_tensors(ckpts, tmp_path):
    gone = "backbone.layers.4.mixer.experts.3.down_proj.weight_scale"
    bad = rewrite(ckpts["nvfp4"], tmp_path / "missing", lambda t: {n: v for n, v in t.items() if n != gone})
    with pytest.raises(RepackError, match=f"{gone} is missing"):
        repack(bad, tmp_path / "s1", progress=False)
    assert not (tmp_path / "s1").exists()       # checked before anything is written
    name = "backbone.layers.7.mixer.experts.9.up_proj.weight"
    bad = rewrite(ckpts["nvfp4"], tmp_path / "shape",
                  lambda t: {n: (v[:, :-2].contiguous() if n == name else v) for n, v in t.items()})
    with pytest.raises(RepackError, match=rf"model-0000\d-of-00002.safetensors: {name} has shape \[96, 30\], "
                                             rf"expected \[96, 32\]"):
        repack(bad, tmp_path / "s2", progress=False)
    assert not (tmp_path / "s2").exists()
