"""The correctness reference: transformers' NemotronHForCausalLM in fp32 on the CPU, fed the dequantized checkpoint.

transformers has no ModelOpt NVFP4 loader, so `dequantize_checkpoint` writes a dense fp32 copy (same tensor
names, scales dropped, no quantization config) with our codec — the codec itself is tested separately against
hand-computed vectors. Every Mamba mixer gets `time_step_limit = (0, inf)`: transformers clamps dt in prefill
only; the production kernels (and this engine) apply no floor.

    python -m tools.hf_reference --model DIR (--ids 1,2,3 | --ids-file F.json) --out OUT.npz [--decode N]

writes the same arrays as `tools.logits` (logits, greedy, greedy_logits).
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from nemotron.checkpoint import Checkpoint

_DROP_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale", ".k_scale", ".v_scale")


def dequantize_checkpoint(model_dir, out_dir, transform=None) -> Path:
    """Write a dense fp32 copy of a checkpoint that transformers can load. `transform(module, QuantizedWeight)`
    may alter weights first (the must-fail twins use it)."""
    ckpt = Checkpoint(model_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = ckpt.tensor_names()
    tensors = {}
    for name in names:
        if name.startswith("mtp.") or name.endswith(_DROP_SUFFIXES):
            continue
        t = ckpt.get(name)
        if name.endswith(".weight") and t.dtype in (torch.uint8, torch.float8_e4m3fn):
            module = name[: -len(".weight")]
            fmt = ckpt.detect_format(module)
            n_in = t.shape[1] * (2 if fmt == "nvfp4" else 1)
            w = ckpt.linear(module, t.shape[0], n_in)
            if transform is not None:
                w = transform(module, w)
            tensors[name] = w.dequantize(torch.float32).contiguous()
        else:
            tensors[name] = t.to(torch.float32).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(ckpt.config.raw)
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    cfg.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (Path(model_dir) / extra).exists():
            shutil.copy(Path(model_dir) / extra, out / extra)
    return out


def load_hf_model(dense_dir):
    from transformers import NemotronHForCausalLM
    model = NemotronHForCausalLM.from_pretrained(str(dense_dir), dtype=torch.float32,
                                                 experts_implementation="eager")
    model.eval()
    for m in model.modules():
        if type(m).__name__ == "NemotronHMamba2Mixer":
            m.time_step_limit = (0.0, float("inf"))
    return model


@torch.inference_mode()
def hf_logits_and_greedy(model, ids: list[int], n_decode: int):
    inp = torch.tensor([ids], dtype=torch.long)
    out = model(input_ids=inp, use_cache=True)
    logits = out.logits[0].float().numpy()
    cache = out.past_key_values
    last = out.logits[0, -1].float()
    greedy, greedy_logits = [], []
    for i in range(n_decode):
        tok = int(last.argmax())
        greedy.append(tok)
        greedy_logits.append(last.numpy())          # row i: the logits token i was chosen from (tools.logits' contract)
        if i + 1 < n_decode:
            step = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            last = step.logits[0, -1].float()
    gl = np.stack(greedy_logits) if greedy_logits else np.zeros((0, logits.shape[1]), np.float32)
    return logits, np.array(greedy, dtype=np.int64), gl


def main(argv=None):
    from tools.logits import read_ids
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids")
    ap.add_argument("--ids-file")
    ap.add_argument("--out", required=True)
    ap.add_argument("--decode", type=int, default=0)
    a = ap.parse_args(argv)
    ids = read_ids(a.ids, a.ids_file)
    with tempfile.TemporaryDirectory(prefix="moestream-hfref-") as tmp:
        model = load_hf_model(dequantize_checkpoint(a.model, tmp))
        logits, greedy, gl = hf_logits_and_greedy(model, ids, a.decode)
    np.savez(a.out, logits=logits, greedy=greedy, greedy_logits=gl)


if __name__ == "__main__":
    main()
