"""Verify a store against its checkpoint: every block (or a sample) decoded back and compared bit for bit.

The checkpoint is read through `nemotron.checkpoint` (safetensors), not through the writer's own shard
reader, so a bug in that reader is not checked against itself.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from expert_store.format import BLOCKS_NAME, INDEX_NAME, StoreError, VerifyError
from expert_store.layout import pack_block, raw_bytes, scale_copy_mismatch, unpack_raw
from expert_store.reader import ExpertStore
from expert_store.source import EXPERT_RE
from expert_store.progress import progress_bar


@dataclass
class VerifyResult:
    blocks_checked: int
    dense_tensors_checked: int
    seconds: float


def verify(store_dir, model_dir, sample: int | None = None, seed: int = 0, progress: bool = True,
           check_dense: bool = True, workers: int | None = None) -> VerifyResult:
    """Decode blocks back and compare them with the checkpoint's tensors bit for bit; raise VerifyError
    naming the first mismatch (layer, expert, section, byte offset)."""
    import torch

    from nemotron.checkpoint import Checkpoint
    t0 = time.perf_counter()
    ckpt = Checkpoint(model_dir)
    cfg = ckpt.config
    try:
        store = ExpertStore.open(store_dir, expected_config_hash=cfg.config_hash())
    except StoreError as e:
        raise VerifyError(str(e)) from e
    geom = store.geometry
    if store.moe_layers != cfg.moe_layers or store.n_experts != cfg.n_routed_experts:
        raise VerifyError(f"{store_dir}: store holds MoE layers {store.moe_layers} x {store.n_experts} experts, the "
                          f"model has {cfg.moe_layers} x {cfg.n_routed_experts}")
    if (geom.L, geom.I) != (cfg.moe_input_size, cfg.moe_intermediate_size):
        raise VerifyError(f"{store_dir}: store geometry L={geom.L} I={geom.I}, the model's experts are "
                          f"L={cfg.moe_input_size} I={cfg.moe_intermediate_size}")
    pairs = [(j, e) for j in range(len(store.moe_layers)) for e in range(store.n_experts)]
    if sample is not None and sample < len(pairs):
        rng = np.random.default_rng(seed)
        pairs = [pairs[i] for i in sorted(rng.choice(len(pairs), size=sample, replace=False))]
    gname = "weight_scale_2" if geom.fmt == "nvfp4" else "weight_scale"

    def raw_of(name):
        return raw_bytes(ckpt.get(name))

    def check_one(j: int, e: int):
        layer = store.moe_layers[j]
        buf = store.read_block(j, e, check=False)
        got = unpack_raw(geom, buf)
        expected = {}
        for proj in ("up", "down"):
            mod = f"backbone.layers.{layer}.mixer.experts.{e}.{proj}_proj"
            expected[f"{proj}_weight"] = (mod + ".weight", raw_of(mod + ".weight"))
            if got[f"{proj}_scale"] is not None:
                expected[f"{proj}_scale"] = (mod + ".weight_scale", raw_of(mod + ".weight_scale"))
        for key, (name, want) in expected.items():
            have = got[key]
            if have.shape != want.reshape(-1, *want.shape[1:]).shape:
                raise VerifyError(f"{store.describe(j, e)}: the checkpoint's {name} is {list(want.shape)} bytes, "
                                  f"the store's block holds {list(have.shape)}")
            if not np.array_equal(have, want):
                _report_block_mismatch(store, j, e, buf, expected, name)
        bad = scale_copy_mismatch(geom, buf)
        if bad is not None:
            s, r = bad
            n = geom.down_group_neurons
            raise VerifyError(f"MISMATCH in {store.describe(j, e)}: down sub-group {s} (neurons {s * n}..{s * n + n - 1}) "
                              f"carries a wrong copy of the scales of 16-neuron group {s * n // 16}: row {r} differs "
                              f"from the group's first copy, which matches the checkpoint")
        try:
            store.check_block(j, e, buf)
        except StoreError as err:
            raise VerifyError(str(err)) from err
        for k, (proj, arr) in enumerate((("up", store.up_global), ("down", store.down_global))):
            if geom.fmt == "bf16":
                continue
            name = f"backbone.layers.{layer}.mixer.experts.{e}.{proj}_proj.{gname}"
            _compare_scalar(store, j, e, f"{proj}_global", arr[j, e], ckpt.get(name), name,
                            store.scalar_ndim[j, e, k])
        if store.up_input_scale is not None:
            for k, (proj, arr) in enumerate((("up", store.up_input_scale), ("down", store.down_input_scale))):
                name = f"backbone.layers.{layer}.mixer.experts.{e}.{proj}_proj.input_scale"
                _compare_scalar(store, j, e, f"{proj}_input_scale", arr[j, e], ckpt.get(name), name,
                                store.scalar_ndim[j, e, 2 + k])
        bar.update(geom.block_bytes)

    # blocks are checked in parallel, in order of (layer, expert) in windows, so the error raised is the
    # first mismatch in file order
    bar = progress_bar(len(pairs) * geom.block_bytes, progress)
    nw = max(1, workers or min(4, os.cpu_count() or 1))
    try:
        with ThreadPoolExecutor(max_workers=nw, thread_name_prefix="verify") as pool:
            window = 16 * nw
            for a in range(0, len(pairs), window):
                futures = [pool.submit(check_one, j, e) for j, e in pairs[a:a + window]]
                for f in futures:
                    f.result()
    finally:
        bar.close()

    n_dense = 0
    if check_dense:
        from safetensors import safe_open
        stored: dict[str, Path] = {}
        for path in store.dense_files + store.mtp_files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    want = ckpt.get(name)
                    have = f.get_tensor(name)
                    if have.dtype != want.dtype or have.shape != want.shape or not torch.equal(
                            _raw_t(have), _raw_t(want)):
                        raise VerifyError(f"{path}: dense tensor {name} differs from the checkpoint "
                                          f"({have.dtype} {list(have.shape)} vs {want.dtype} {list(want.shape)})")
                    stored[name] = path
                    n_dense += 1
        view = Checkpoint(store_dir)
        if view.config.config_hash() != cfg.config_hash():
            raise VerifyError(f"{Path(store_dir) / 'config.json'}: config hash {view.config.config_hash()}, the "
                              f"model's is {cfg.config_hash()}")
        for name in store.manifest.get("side_files", []):
            if (Path(store_dir) / name).read_bytes() != (Path(model_dir) / name).read_bytes():
                raise VerifyError(f"{Path(store_dir) / name}: differs from {Path(model_dir) / name}")
        if set(view.tensor_names()) != set(stored):
            raise VerifyError(f"{Path(store_dir) / INDEX_NAME}: does not list exactly the dense and mtp tensors")
        expert_names = {n for n in ckpt.tensor_names() if EXPERT_RE.match(n)}
        missing = [n for n in ckpt.tensor_names() if n not in stored and n not in expert_names]
        if missing:
            raise VerifyError(f"{store_dir}: {len(missing)} non-routed tensors are not in the dense files, "
                              f"first {missing[0]}")
    return VerifyResult(len(pairs), n_dense, time.perf_counter() - t0)


def _raw_t(t):
    import torch
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def _compare_scalar(store, j, e, what, have, want_t, name, ndim):
    want = raw_bytes(want_t).view(np.float32).reshape(-1)
    if want.size != 1 or np.float32(have).view(np.uint32) != want[0].view(np.uint32):
        raise VerifyError(f"{store.describe(j, e)}: {what} in {BLOCKS_NAME} is {float(have)!r}, the checkpoint's "
                          f"{name} is {want.tolist()}")
    if want_t.dim() != int(ndim):
        raise VerifyError(f"{store.describe(j, e)}: {name} is stored with shape {list(want_t.shape)}, the store "
                          f"rebuilds it with ndim {int(ndim)}")


def _report_block_mismatch(store: ExpertStore, j, e, buf, expected, name):
    geom = store.geometry
    ref = pack_block(geom, *(None if expected.get(k) is None else expected[k][1].reshape(geom.raw_shapes()[k])
                             for k in ("up_weight", "up_scale", "down_weight", "down_scale")))
    have = np.asarray(buf[:geom.block_bytes])
    diff = np.flatnonzero(have != ref)
    if diff.size == 0:     # cannot happen if pack/unpack are inverse; say so rather than hide it
        raise VerifyError(f"{store.describe(j, e)}: decoded {name} differs from the checkpoint, but the block "
                          f"bytes equal a fresh pack: pack/unpack disagree")
    b = int(diff[0])
    sec = geom.section_at(b)
    mod = name.rsplit(".", 2)[0]      # backbone.layers.i.mixer.experts.e
    if sec == "up_values":
        r, c = divmod(b - geom.up_values.offset, geom.raw_shapes()["up_weight"][1])
        where = f"{mod}.up_proj.weight byte [{r}, {c}]"
    elif sec == "up_scales":
        r, c = divmod(b - geom.up_scales.offset, geom.raw_shapes()["up_scale"][1])
        where = f"{mod}.up_proj.weight_scale [{r}, {c}]"
    elif sec == "down_groups":
        g, o = divmod(b - geom.down_groups.offset, geom.group_bytes)
        rv, n = geom.group_row_value_bytes, geom.down_group_neurons
        if o < geom.group_value_bytes and rv is None:
            where = f"group {g}: {mod}.down_proj.weight neuron {g}, rows {2 * o} and {2 * o + 1}"
        elif o < geom.group_value_bytes:
            r, c = divmod(o, rv)
            where = f"group {g}: {mod}.down_proj.weight byte [{r}, {g * rv + c}]"
        else:
            where = f"group {g}: {mod}.down_proj.weight_scale [{o - geom.group_value_bytes}, {g * n // 16}]"
    else:
        where = "padding between sections"
    raise VerifyError(f"MISMATCH in {store.describe(j, e)}: section {sec}, byte {b:,} of the block "
                      f"(file offset {int(store.offsets[j, e]) + b:,}; {where}): store 0x{int(have[b]):02x}, "
                      f"checkpoint 0x{int(ref[b]):02x}; {diff.size:,} bytes of the block differ")
