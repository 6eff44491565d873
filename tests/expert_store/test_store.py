"""expert_store: the block layout and the store reader, without a checkpoint: geometry, packing, views, errors."""
from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pytest
import torch

from expert_store.format import (EXPERTS_NAME, BLOCKS_NAME, FORMAT_NAME, FORMAT_VERSION, JOURNAL_NAME, MANIFEST_NAME,
                                 StoreError, geometry_from_dict, write_manifest)
from expert_store.layout import block_views, pack_block, raw_bytes, unpack_block, unpack_raw
from expert_store.reader import ExpertStore
from kernels.expert_block import BLOCK_ALIGN, FORMATS, ExpertGeometry
from kernels.nvfp4 import decode_fp8, decode_nvfp4, encode_fp8, encode_nvfp4


# ------------------------------------------------------------------------------------------ geometry
def test_super_nvfp4_geometry_is_the_contract():
    g = ExpertGeometry(1024, 2688, "nvfp4")
    assert g.block_bytes == 3_096_576 == g.block_stride
    assert g.pages == 756
    assert (g.up_values.offset, g.up_values.nbytes) == (0, 1_376_256)
    assert (g.up_scales.offset, g.up_scales.nbytes) == (1_376_256, 172_032)
    assert (g.down_groups.offset, g.down_groups.nbytes) == (1_548_288, 1_548_288)
    assert g.group_bytes == 9_216 and g.n_groups == 168


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("L,I", [(2688, 1856), (1024, 2688), (32, 48), (80, 112)])
def test_geometry_alignment(kind, L, I):
    g = ExpertGeometry(L, I, kind)
    for s in g.sections():
        assert s.offset % 256 == 0   # docs/block-layout.md: sections start on 256-byte boundaries
    assert g.up_values.end <= g.up_scales.offset <= g.up_scales.end <= g.down_groups.offset
    assert g.block_bytes == g.down_groups.end and g.block_stride % BLOCK_ALIGN == 0
    assert 0 <= g.block_stride - g.block_bytes < BLOCK_ALIGN
    assert geometry_from_dict(g.to_dict()) == g


def test_geometry_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiples of 16"):
        ExpertGeometry(1000, 2688, "nvfp4")
    with pytest.raises(ValueError, match="unknown block kind"):
        ExpertGeometry(1024, 2688, "int4")
    d = ExpertGeometry(64, 48, "nvfp4").to_dict()
    d["block_stride"] = 8192
    with pytest.raises(StoreError, match="disagrees"):
        geometry_from_dict(d)


# ------------------------------------------------------------------------------------------ packing
def _expert(kind, L, I, seed=0):
    """Checkpoint tensors of one expert: (up_w, up_s, up_g, down_w, down_s, down_g)."""
    gen = torch.Generator().manual_seed(seed)
    up, down = torch.randn(I, L, generator=gen), torch.randn(L, I, generator=gen)
    if kind == "nvfp4":
        return (*encode_nvfp4(up), *encode_nvfp4(down))
    if kind == "fp8":
        (uw, ug), (dw, dg) = encode_fp8(up), encode_fp8(down)
        return uw, None, ug, dw, None, dg
    return up.bfloat16(), None, None, down.bfloat16(), None, None


def _u8(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("kind", FORMATS)
def test_pack_unpack_round_trip(kind):
    L, I = 80, 112          # 7 groups; L not a power of two
    g = ExpertGeometry(L, I, kind)
    uw, us, ug, dw, ds, dg = _expert(kind, L, I)
    block = pack_block(g, uw, us, dw, ds)
    assert block.dtype == np.uint8 and block.size == g.block_bytes
    up, down = unpack_block(g, block, ug, dg)
    assert torch.equal(_u8(up.weight), _u8(uw)) and torch.equal(_u8(down.weight), _u8(dw))
    assert up.weight.dtype == uw.dtype and down.weight.dtype == dw.dtype
    assert (up.out_features, up.in_features, down.out_features, down.in_features) == (I, L, L, I)
    if kind == "nvfp4":
        assert torch.equal(_u8(up.weight_scale), _u8(us)) and torch.equal(_u8(down.weight_scale), _u8(ds))
        assert torch.equal(up.weight_scale_2, ug) and torch.equal(down.weight_scale_2, dg)
        assert torch.equal(down.dequantize(), decode_nvfp4(dw, ds, dg))
    elif kind == "fp8":
        assert torch.equal(down.dequantize(), decode_fp8(dw, dg))
    else:
        assert torch.equal(down.dequantize(), dw.float())
    for a, b in ((g.up_values.end, g.up_scales.offset), (g.up_scales.end, g.down_groups.offset)):
        assert not block[a:b].any()      # section padding is zero
    raw = unpack_raw(g, block)
    assert np.array_equal(raw["down_weight"], raw_bytes(dw))


def test_views_follow_the_layout_and_do_not_copy():
    L, I = 64, 48
    g = ExpertGeometry(L, I, "nvfp4")
    uw, us, ug, dw, ds, dg = _expert("nvfp4", L, I, seed=1)
    block = torch.from_numpy(pack_block(g, uw, us, dw, ds))
    v = block_views(g, block)
    base, end = block.data_ptr(), block.data_ptr() + block.numel()
    for name, t in v.items():
        assert base <= t.data_ptr() < end, name
    assert v["up_values"].shape == (I, L // 2) and v["up_scales"].dtype == torch.float8_e4m3fn
    assert v["down_values"].shape == (I // 16, L, 8) and v["down_scales"].shape == (I // 16, L)
    for grp in range(I // 16):
        assert torch.equal(v["down_values"][grp], dw[:, 8 * grp:8 * grp + 8])
        assert torch.equal(_u8(v["down_scales"][grp]), _u8(ds[:, grp]))
        # a group is 9L contiguous bytes: values then scales
        off = g.down_groups.offset + grp * 9 * L
        assert torch.equal(block[off:off + 8 * L].view(L, 8), dw[:, 8 * grp:8 * grp + 8])
    assert torch.equal(v["up_values"], uw) and torch.equal(_u8(v["up_scales"]), _u8(us))


def test_sparse_down_from_groups_equals_dense_decode():
    """What the sparse down kernel does, in torch: only groups with a non-zero activation are read."""
    L, I = 64, 96
    g = ExpertGeometry(L, I, "nvfp4")
    uw, us, ug, dw, ds, dg = _expert("nvfp4", L, I, seed=2)
    v = block_views(g, pack_block(g, uw, us, dw, ds))
    a = torch.zeros(I)
    a[[3, 40, 41, 90]] = torch.tensor([1.5, -2.0, 0.25, 3.0])
    want = decode_nvfp4(dw, ds, dg) @ a
    y = torch.zeros(L)
    for grp in torch.unique(torch.nonzero(a).flatten() // 16).tolist():
        wg = decode_nvfp4(v["down_values"][grp], v["down_scales"][grp].reshape(L, 1), dg)   # [L, 16]
        y += wg @ a[16 * grp:16 * grp + 16]
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    # must-fail twin: the layout read as if down were stored untouched gives another answer
    wrong = decode_nvfp4(v["down_groups"].reshape(-1)[:L * I // 2].reshape(L, I // 2), ds, dg) @ a
    assert not torch.allclose(wrong, want)


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_views_fp8_bf16(kind):
    L, I = 32, 48
    g = ExpertGeometry(L, I, kind)
    uw, _, _, dw, _, _ = _expert(kind, L, I, seed=3)
    v = block_views(g, bytes(pack_block(g, uw, None, dw, None)))
    assert v["up_scales"] is None and v["down_scales"] is None
    assert torch.equal(_u8(v["up_values"]), _u8(uw)) and v["up_values"].dtype == uw.dtype
    for grp in range(I // 16):
        assert torch.equal(_u8(v["down_values"][grp]), _u8(dw[:, 16 * grp:16 * grp + 16]))


def test_pack_rejects_wrong_shapes():
    g = ExpertGeometry(64, 48, "nvfp4")
    uw, us, ug, dw, ds, dg = _expert("nvfp4", 64, 48)
    with pytest.raises(ValueError, match="down_weight"):
        pack_block(g, uw, us, dw[:, :-1], ds)
    with pytest.raises(ValueError, match="up_scale: missing"):
        pack_block(g, uw, None, dw, ds)


# ------------------------------------------------------------------------------------------ the reader
def _write_store(d, kind="nvfp4", n_moe=2, E=3, L=32, I=48, config_hash="abc123"):
    g = ExpertGeometry(L, I, kind)
    offsets = np.zeros((n_moe, E), np.int64)
    crcs = np.zeros((n_moe, E), np.uint32)
    ug = np.ones((n_moe, E), np.float32)
    dg = np.ones((n_moe, E), np.float32)
    experts = {}
    with open(d / EXPERTS_NAME, "wb") as f:
        for j in range(n_moe):
            for e in range(E):
                t = _expert(kind, L, I, seed=10 * j + e)
                experts[j, e] = t
                b = pack_block(g, t[0], t[1], t[3], t[4])
                offsets[j, e] = f.tell()
                crcs[j, e] = zlib.crc32(b.tobytes())
                if kind != "bf16":
                    ug[j, e], dg[j, e] = float(t[2]), float(t[5])
                f.write(b.tobytes() + bytes(g.block_stride - g.block_bytes))
    manifest = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "state": "complete",
                "config_hash": config_hash, "geometry": g.to_dict(), "moe_layers": [1, 3][:n_moe],
                "n_experts": E, "experts_file": EXPERTS_NAME}
    write_manifest(d, manifest, {"offsets": offsets, "checksums": crcs, "up_global": ug, "down_global": dg})
    return experts


def test_store_open_and_read(tmp_path):
    experts = _write_store(tmp_path)
    s = ExpertStore.open(tmp_path, expected_config_hash="abc123")
    assert (s.block_bytes, s.block_stride, s.n_experts, s.moe_layers) == (1888, 4096, 3, [1, 3])
    assert s.offsets.dtype == np.int64 and s.checksums.dtype == np.uint32 and s.up_global.dtype == np.float32
    assert s.offsets[1, 2] == 5 * 4096 and s.moe_index[3] == 1
    for (j, e), t in experts.items():
        buf = s.read_block(j, e)
        up, down = s.unpack_block(buf, j, e)
        assert torch.equal(up.weight, t[0]) and torch.equal(_u8(down.weight_scale), _u8(t[4]))
        assert torch.equal(down.weight_scale_2, t[5])
        assert torch.equal(s.block_views(buf)["up_values"], t[0])


def test_store_other_model_is_refused(tmp_path):
    _write_store(tmp_path)
    with pytest.raises(StoreError) as ei:
        ExpertStore.open(tmp_path, expected_config_hash="ffff0000")
    msg = str(ei.value)
    assert str(tmp_path) in msg and "abc123" in msg and "ffff0000" in msg


def test_store_other_format_version_is_refused(tmp_path):
    _write_store(tmp_path)
    p = tmp_path / MANIFEST_NAME
    m = json.loads(p.read_text())
    m["format_version"] = FORMAT_VERSION + 1
    p.write_text(json.dumps(m))
    with pytest.raises(StoreError, match="format version"):
        ExpertStore.open(tmp_path)


def test_store_truncated_file_names_the_first_missing_block(tmp_path):
    _write_store(tmp_path)
    os.truncate(tmp_path / EXPERTS_NAME, 4 * 4096 + 100)
    with pytest.raises(StoreError, match=r"truncated.*moe layer 1 = model layer 3, expert 1"):
        ExpertStore.open(tmp_path)


def test_store_checksum_mismatch_names_the_block(tmp_path):
    _write_store(tmp_path)
    s = ExpertStore.open(tmp_path)
    with open(s.experts_path, "r+b") as f:
        f.seek(int(s.offsets[1, 2]) + 777)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(StoreError, match=r"checksum mismatch in block \(moe layer 1 = model layer 3, expert 2\)"):
        s.read_block(1, 2)
    s.read_block(1, 1)


def test_store_incomplete_and_foreign_sidecar(tmp_path):
    (tmp_path / JOURNAL_NAME).write_text("{}\n")
    with pytest.raises(StoreError, match="incomplete store"):
        ExpertStore.open(tmp_path)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    _write_store(a, E=3)
    _write_store(b, E=4)
    os.replace(b / BLOCKS_NAME, a / BLOCKS_NAME)
    with pytest.raises(StoreError, match="crc32"):
        ExpertStore.open(a)
