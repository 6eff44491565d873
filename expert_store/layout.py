"""Block bytes <-> checkpoint tensors: the store's packer, its inverse, and views of a block in any buffer.

Packing and unpacking are pure byte rearrangements (no re-quantization), so a block decodes back to the
checkpoint's tensors bit for bit. numpy at the top; torch is imported by the functions that return tensors.
"""
from __future__ import annotations

import zlib

import numpy as np

from expert_store.format import StoreError
from kernels import expert_block
from kernels.expert_block import GROUP, ExpertGeometry


def raw_bytes(t) -> np.ndarray:
    """A tensor's storage as a uint8 numpy array, last dim in bytes (bf16 [r, c] -> [r, 2c]); no copy if contiguous."""
    if isinstance(t, np.ndarray):
        a = np.ascontiguousarray(t)
        return a.view(np.uint8) if a.ndim else a.reshape(1).view(np.uint8)
    import torch
    t = t.detach().contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)
    return t.numpy()


def _check_raw(name: str, a, shape):
    if shape is None:
        if a is not None:
            raise ValueError(f"{name}: this block kind has no {name}")
        return None
    if a is None:
        raise ValueError(f"{name}: missing")
    a = raw_bytes(a)
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: raw byte shape {tuple(a.shape)}, expected {tuple(shape)}")
    return a


def pack_block(geom: ExpertGeometry, up_weight, up_scale, down_weight, down_scale, out: np.ndarray | None = None
               ) -> np.ndarray:
    """Checkpoint tensors (torch or numpy, any dtype; scales None for fp8/bf16) -> block bytes, uint8[block_bytes].

    `out`, if given, is a uint8 buffer of at least block_bytes whose padding bytes are already zero (a reused
    buffer keeps them zero: packing writes only the sections).
    """
    shapes = geom.raw_shapes()
    uw = _check_raw("up_weight", up_weight, shapes["up_weight"])
    us = _check_raw("up_scale", up_scale, shapes["up_scale"])
    dw = _check_raw("down_weight", down_weight, shapes["down_weight"])
    ds = _check_raw("down_scale", down_scale, shapes["down_scale"])
    buf = np.zeros(geom.block_bytes, np.uint8) if out is None else out[:geom.block_bytes]
    s = geom.up_values
    buf[s.offset:s.end] = uw.reshape(-1)
    if us is not None:
        s = geom.up_scales
        buf[s.offset:s.end] = us.reshape(-1)
    G, L, rv, gv = geom.n_groups, geom.L, geom.group_row_value_bytes, geom.group_value_bytes
    s = geom.down_groups
    groups = buf[s.offset:s.end].reshape(G, geom.group_bytes)
    # group g holds, for every output row r, the bytes of neurons n·g..n·g+n-1, then the rows' scales of the
    # 16-neuron group that holds them (each of its 16/n sub-groups carries a copy)
    if rv is not None:
        groups[:, :gv].reshape(G, L, rv)[:] = dw.reshape(L, G, rv).transpose(1, 0, 2)
    else:       # NVFP4 groups of one neuron: its L codes, two rows to a byte, low nibble first
        codes = np.stack((dw & 15, dw >> 4), axis=-1).reshape(L, G).T          # [G = I, L]
        groups[:, :gv] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    if ds is not None:
        groups[:, gv:] = np.repeat(ds.T, GROUP // geom.down_group_neurons, axis=0)
    return buf


def unpack_raw(geom: ExpertGeometry, buf) -> dict[str, np.ndarray | None]:
    """Block bytes -> the four checkpoint tensors as raw uint8 arrays (shapes of `geom.raw_shapes()`)."""
    b = _as_np_u8(buf, geom)
    shapes = geom.raw_shapes()
    s = geom.up_values
    out = {"up_weight": b[s.offset:s.end].reshape(shapes["up_weight"]), "up_scale": None, "down_scale": None}
    if shapes["up_scale"] is not None:
        s = geom.up_scales
        out["up_scale"] = b[s.offset:s.end].reshape(shapes["up_scale"])
    G, L, rv, gv = geom.n_groups, geom.L, geom.group_row_value_bytes, geom.group_value_bytes
    s = geom.down_groups
    groups = b[s.offset:s.end].reshape(G, geom.group_bytes)
    if rv is not None:
        values = groups[:, :gv].reshape(G, L, rv).transpose(1, 0, 2)       # [L, G, rv]
        out["down_weight"] = np.ascontiguousarray(values).reshape(L, G * rv)
    else:
        v = groups[:, :gv]
        codes = np.stack((v & 15, v >> 4), axis=-1).reshape(G, L).T         # [L, I]
        out["down_weight"] = np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << 4))
    if shapes["down_scale"] is not None:     # the first copy of each 16-group's scales (`scale_copy_mismatch`)
        out["down_scale"] = np.ascontiguousarray(groups[::GROUP // geom.down_group_neurons, gv:].T)
    return out


def scale_copy_mismatch(geom: ExpertGeometry, buf) -> tuple[int, int] | None:
    """(sub-group, row) of the first down sub-group whose scales differ from its 16-group's first copy, or
    None. `unpack_raw` reads the first copy only, so this is what proves the others."""
    per = GROUP // geom.down_group_neurons
    if geom.fmt != "nvfp4" or per == 1:
        return None
    b = _as_np_u8(buf, geom)
    s = geom.down_groups
    scales = b[s.offset:s.end].reshape(geom.n_scale_groups, per, geom.group_bytes)[:, :, geom.group_value_bytes:]
    bad = np.argwhere(scales != scales[:, :1])
    if bad.size == 0:
        return None
    g, k, r = (int(v) for v in bad[0])
    return g * per + k, r


def _as_np_u8(buf, geom: ExpertGeometry) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        b = buf.reshape(-1).view(np.uint8)
    elif type(buf).__module__.startswith("torch"):
        b = raw_bytes(buf).reshape(-1)
    else:
        b = np.frombuffer(buf, np.uint8)
    if b.size < geom.block_bytes:
        raise StoreError(f"block buffer has {b.size} bytes, a {geom.fmt} block needs {geom.block_bytes}")
    return b


def _as_torch_u8(buf, geom: ExpertGeometry):
    import warnings

    import torch
    if isinstance(buf, torch.Tensor):
        t = buf.reshape(-1)
        if t.dtype != torch.uint8:
            t = t.view(torch.uint8)
    else:
        with warnings.catch_warnings():   # read-only buffers: the views are read-only in practice
            warnings.simplefilter("ignore")
            if isinstance(buf, np.ndarray):
                t = torch.from_numpy(buf.reshape(-1).view(np.uint8))
            else:
                t = torch.frombuffer(buf, dtype=torch.uint8)
    if t.numel() < geom.block_bytes:
        raise StoreError(f"block buffer has {t.numel()} bytes, a {geom.fmt} block needs {geom.block_bytes}")
    return t


def block_views(geom: ExpertGeometry, buf) -> dict:
    """Torch views (no copy) of a block's parts in `buf` (torch uint8, numpy, bytes, memoryview); the parts
    are those of `kernels.expert_block.block_views`."""
    return expert_block.block_views(geom, _as_torch_u8(buf, geom))


def unpack_block(geom: ExpertGeometry, buf, up_global=None, down_global=None):
    """Block bytes (+ the manifest's globals) -> (up, down) `kernels.linear.QuantizedWeight`, the checkpoint's
    tensors exactly (copies; down is un-grouped back to [L, I/2] / [L, I])."""
    import torch

    from kernels.linear import QuantizedWeight
    raw = unpack_raw(geom, buf)
    L, I = geom.L, geom.I

    def scalar(v):
        return None if v is None else torch.tensor(float(np.float32(v)), dtype=torch.float32)

    def tensor(a, dtype):
        t = torch.from_numpy(np.array(a, np.uint8, copy=True))
        return t if dtype == torch.uint8 else t.view(dtype)

    if geom.fmt == "nvfp4":
        e4 = torch.float8_e4m3fn
        up = QuantizedWeight("nvfp4", tensor(raw["up_weight"], torch.uint8), tensor(raw["up_scale"], e4),
                             scalar(up_global), I, L)
        down = QuantizedWeight("nvfp4", tensor(raw["down_weight"], torch.uint8), tensor(raw["down_scale"], e4),
                               scalar(down_global), L, I)
    elif geom.fmt == "fp8":
        e4 = torch.float8_e4m3fn
        up = QuantizedWeight("fp8", tensor(raw["up_weight"], e4), scalar(up_global), None, I, L)
        down = QuantizedWeight("fp8", tensor(raw["down_weight"], e4), scalar(down_global), None, L, I)
    else:
        bf = torch.bfloat16
        up = QuantizedWeight("dense", tensor(raw["up_weight"], bf), None, None, I, L)
        down = QuantizedWeight("dense", tensor(raw["down_weight"], bf), None, None, L, I)
    return up, down


def block_crc(buf, geom: ExpertGeometry) -> int:
    return zlib.crc32(memoryview(_as_np_u8(buf, geom)[:geom.block_bytes]))
