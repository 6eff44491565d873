"""Bad checkpoints get a clear error naming the file, the tensor and what was expected; never garbage."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nemotron.checkpoint import Checkpoint, CheckpointError
from nemotron.config import ConfigError
from nemotron.model import NemotronH
from tools import logits as logits_tool


def clone(src, tmp_path, name="bad"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def rewrite_tensor(model_dir, name, fn):
    """Apply fn to one tensor (None deletes it) in its shard, keeping the index consistent."""
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = model_dir / index["weight_map"][name]
    tensors = load_file(shard)
    new = fn(tensors[name])
    if new is None:
        del tensors[name]
        del index["weight_map"][name]
        index_path.write_text(json.dumps(index))
    else:
        tensors[name] = new
    save_file(tensors, shard, metadata={"format": "pt"})


def first(ckpt_dir, suffix, dtype=None):
    ck = Checkpoint(ckpt_dir)
    for n in ck.tensor_names():
        if n.endswith(suffix) and (dtype is None or ck.get(n).dtype == dtype):
            return n
    raise AssertionError(f"no tensor ending in {suffix}")


def test_missing_shard(synth, tmp_path):
    d = clone(synth("tiny", "nvfp4"), tmp_path)
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name}.*missing"):
        Checkpoint(d)


def test_missing_tensor_named(synth, tmp_path):
    d = clone(synth("tiny", "nvfp4"), tmp_path)
    name = first(d, "mixer.A_log")
    rewrite_tensor(d, name, lambda t: None)
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is missing"):
        NemotronH(d)


def test_wrong_shape_named(synth, tmp_path):
    d = clone(synth("tiny", "nvfp4"), tmp_path)
    name = first(d, "up_proj.weight", torch.uint8)
    rewrite_tensor(d, name, lambda t: t[:, :-1].contiguous())
    with pytest.raises(CheckpointError, match=rf"{name} has shape .* expected"):
        NemotronH(d)   # found from the headers at load, not when a prompt first routes to the expert


def test_wrong_scale_dtype(synth, tmp_path):
    d = clone(synth("tiny", "nvfp4"), tmp_path)
    name = first(d, ".weight_scale", torch.float8_e4m3fn)
    rewrite_tensor(d, name, lambda t: t.float())
    module = name[: -len(".weight_scale")]
    ck = Checkpoint(d)
    w = ck.get(module + ".weight")
    with pytest.raises(CheckpointError, match="weight_scale has dtype"):
        ck.linear(module, w.shape[0], w.shape[1] * 2)


def test_wrong_norm_dtype(synth, tmp_path):
    d = clone(synth("tiny", "bf16"), tmp_path)
    name = first(d, "norm_f.weight")
    rewrite_tensor(d, name, lambda t: t.to(torch.int32))
    with pytest.raises(CheckpointError, match="norm_f.weight has dtype torch.int32, expected a float"):
        NemotronH(d)


def test_unknown_quant_algo(synth, tmp_path):
    d = clone(synth("tiny", "nvfp4"), tmp_path)
    for f in ("config.json", "hf_quant_config.json"):
        p = d / f
        if p.exists():
            p.write_text(p.read_text().replace('"NVFP4"', '"INT4_AWQ"'))
    with pytest.raises(CheckpointError, match="unknown quantization algorithm 'INT4_AWQ'"):
        Checkpoint(d)


def test_unknown_layer_type(synth, tmp_path):
    d = clone(synth("tiny", "bf16"), tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["hybrid_override_pattern"] = cfg["hybrid_override_pattern"][:-1] + "Q"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unknown layer type 'Q'"):
        Checkpoint(d)


def test_mixed_precision_mismatch(synth, tmp_path):
    """quantized_layers says FP8 for a module whose tensors are NVFP4: refuse, naming both."""
    d = clone(synth("tiny", "mixed"), tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    ql = cfg["quantization_config"]["quantized_layers"]
    module = next(m for m, s in ql.items() if s["quant_algo"] == "NVFP4")
    ql[module] = {"quant_algo": "FP8"}
    (d / "config.json").write_text(json.dumps(cfg))
    ck = Checkpoint(d)
    full = module if ck.has(module + ".weight") else "backbone." + module.removeprefix("model.")
    w = ck.get(full + ".weight")
    with pytest.raises(CheckpointError, match="stored as nvfp4 but .* says fp8"):
        ck.linear(full, w.shape[0], w.shape[1] * 2)


def test_scalar_forms_equivalent(synth, tmp_path):
    d = clone(synth("tiny", "nvfp4"), tmp_path)
    name = first(d, ".weight_scale_2")
    module = name[: -len(".weight_scale_2")]
    ck = Checkpoint(d)
    w = ck.get(module + ".weight")
    before = ck.linear(module, w.shape[0], w.shape[1] * 2).dequantize()
    shape = tuple(ck.get(name).shape)
    rewrite_tensor(d, name, lambda t: t.reshape(1) if t.dim() == 0 else t.reshape(()))
    ck2 = Checkpoint(d)
    assert tuple(ck2.get(name).shape) != shape
    torch.testing.assert_close(ck2.linear(module, w.shape[0], w.shape[1] * 2).dequantize(), before, rtol=0, atol=0)


def test_logits_tool_reports_errors(synth, tmp_path, capsys):
    d = clone(synth("tiny", "nvfp4"), tmp_path)
    sorted(d.glob("model-*.safetensors"))[0].unlink()
    rc = logits_tool.main(["--model", str(d), "--ids", "1,2,3", "--out", str(tmp_path / "o.npz")])
    assert rc == 2
    assert "missing" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="comma-separated"):
        logits_tool.main(["--model", str(d), "--ids", "1,x", "--out", str(tmp_path / "o.npz")])
