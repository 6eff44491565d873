"""Reading NemotronH checkpoints in their published (HuggingFace hub) layout.

Sharded safetensors with `model.safetensors.index.json` (or one `model.safetensors`); tensor names with the
`backbone.` prefix. Each Linear's format is decided from the tensors present and cross-checked with the
quantization config (`hf_quant_config.json` or config.json `quantization_config`):
  NVFP4 (ModelOpt): weight U8 [out, in/2], weight_scale F8_E4M3 [out, in/16], weight_scale_2 F32 scalar
  FP8 per-tensor:   weight F8_E4M3 [out, in], weight_scale F32 scalar
  dense:            weight BF16/F16/F32 [out, in]
Scalars may be stored 0-dim or [1]. `input_scale`, `k_scale`, `v_scale` are read by nobody (W4A16, bf16 KV).

Omni / VL checkpoints (config.json with a nested `llm_config` / `text_config`) store the language model under
`language_model.` (`language_model.backbone.…`, `language_model.lm_head.weight`, as released and as transformers'
`save_pretrained` writes): those names are served without the prefix, so everything downstream reads the
text names; the vision tensors (`vision_model.…`, `mlp1.…`, `vision_projector.…`) keep theirs.
"""
from __future__ import annotations

import fnmatch
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from kernels.linear import QuantizedWeight
from nemotron.config import NemotronHConfig

KNOWN_ALGOS = ("NVFP4", "FP8", "MIXED_PRECISION")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LANGUAGE_MODEL_PREFIX = "language_model."     # of the language model's tensors in an Omni / VL checkpoint


class CheckpointError(ValueError):
    pass


@dataclass
class QuantConfig:
    algo: str | None = None                       # None = unquantized checkpoint
    exclude_modules: list[str] = field(default_factory=list)
    quantized_layers: dict[str, str] = field(default_factory=dict)   # module -> 'NVFP4' | 'FP8'
    group_size: int = 16
    source: str = ""
    prefix: str = ""                              # stored-name prefix of the language model (Omni / VL)

    @classmethod
    def from_model_dir(cls, model_dir: Path, config_dict: dict) -> "QuantConfig":
        q = config_dict.get("quantization_config")
        source = "config.json quantization_config"
        hfq_path = model_dir / "hf_quant_config.json"
        hfq = None
        if hfq_path.exists():
            try:
                hfq = json.loads(hfq_path.read_text()).get("quantization", {})
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{hfq_path}: not valid JSON ({e})") from e
        if q is None and hfq is None:
            return cls()
        if q is None:
            q, source = hfq, str(hfq_path)
        method = q.get("quant_method", "modelopt")
        if method != "modelopt":
            raise CheckpointError(f"{source}: quant_method {method!r} is not supported (only ModelOpt 'modelopt')")
        algo = q.get("quant_algo") or (hfq or {}).get("quant_algo")
        if algo is None:
            raise CheckpointError(f"{source}: no quant_algo")
        algo = str(algo).upper()
        if algo not in KNOWN_ALGOS:
            raise CheckpointError(f"{source}: unknown quantization algorithm {algo!r} (known: {', '.join(KNOWN_ALGOS)})")
        excl = q.get("exclude_modules", q.get("ignore")) or (hfq or {}).get("exclude_modules") or []
        ql = q.get("quantized_layers") or (hfq or {}).get("quantized_layers") or {}
        layers = {}
        for mod, spec in ql.items():
            a = str(spec.get("quant_algo", "")).upper()
            if a not in ("NVFP4", "FP8"):
                raise CheckpointError(f"{source}: quantized_layers[{mod!r}] has unknown quant_algo {a!r}")
            layers[mod] = a
        if algo == "MIXED_PRECISION" and not layers:
            raise CheckpointError(f"{source}: MIXED_PRECISION without quantized_layers")
        return cls(algo, list(excl), layers, int(q.get("group_size", 16) or 16), source)

    def expected(self, module: str) -> str:
        """What the config says this Linear should be: 'nvfp4' | 'fp8' | 'dense'."""
        if self.algo is None:
            return "dense"
        if self.algo == "MIXED_PRECISION":
            short = module.removeprefix("backbone.")
            a = self.quantized_layers.get(module) or self.quantized_layers.get(short) \
                or self.quantized_layers.get("model." + short) \
                or (self.quantized_layers.get(self.prefix + module) if self.prefix else None)
            return {"NVFP4": "nvfp4", "FP8": "fp8", None: "dense"}[a]
        if self._excluded(module):
            return "dense"
        return self.algo.lower()

    def _excluded(self, module: str) -> bool:
        names = {module, module.removeprefix("backbone."), "model." + module.removeprefix("backbone.")}
        if self.prefix:
            names.add(self.prefix + module)
        for pat in self.exclude_modules:
            for n in names:
                if fnmatch.fnmatchcase(n, pat) or n == pat or n.startswith(pat.rstrip("*") + ".") and pat.endswith("*"):
                    return True
        return False


class Checkpoint:
    def __init__(self, model_dir):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: model directory does not exist")
        self.config = NemotronHConfig.from_dir(self.dir)
        mm = self.config.multimodal
        qcfg = self.config.raw if mm is None or "quantization_config" not in mm else mm
        self.quant = QuantConfig.from_model_dir(self.dir, qcfg)
        self._shard_of = self._read_index()
        self._stored: dict[str, str] = {}         # served name -> name in the shard, where they differ
        if mm is not None:
            self.quant.prefix = LANGUAGE_MODEL_PREFIX
            for stored in [n for n in self._shard_of if n.startswith(LANGUAGE_MODEL_PREFIX)]:
                name = stored[len(LANGUAGE_MODEL_PREFIX):]
                if name in self._shard_of:
                    raise CheckpointError(f"{self.dir}: both {stored!r} and {name!r} are in the checkpoint")
                self._shard_of[name] = self._shard_of.pop(stored)
                self._stored[name] = stored
        self._handles: dict[Path, object] = {}

    # ------------------------------------------------------------------ files
    def _read_index(self) -> dict[str, Path]:
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            try:
                wm = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from e
            shard_of = {name: self.dir / fname for name, fname in wm.items()}
            for shard in sorted(set(shard_of.values())):
                if not shard.exists():
                    raise CheckpointError(f"{shard}: shard listed in {index.name} is missing")
            return shard_of
        single = self.dir / "model.safetensors"
        if not single.exists():
            raise CheckpointError(f"{self.dir}: neither model.safetensors.index.json nor model.safetensors")
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}

    def _handle(self, shard: Path):
        h = self._handles.get(shard)
        if h is None:
            try:
                h = safe_open(shard, framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"{shard}: cannot open as safetensors ({e})") from e
            self._handles[shard] = h
        return h

    def tensor_names(self) -> list[str]:
        return list(self._shard_of)

    def has(self, name: str) -> bool:
        return name in self._shard_of

    def shard_of(self, name: str) -> Path:
        return self._shard_of[name]

    def stored_name(self, name: str) -> str:
        """The tensor's name inside its shard (differs only for an Omni / VL language model's tensors)."""
        return self._stored.get(name, name)

    def get(self, name: str) -> torch.Tensor:
        shard = self._shard_of.get(name)
        if shard is None:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        try:
            return self._handle(shard).get_tensor(self._stored.get(name, name))
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{shard}: cannot read tensor {name!r} ({e})") from e

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype string, shape) from the shard's header, without reading the data."""
        shard = self._shard_of.get(name)
        if shard is None:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        try:
            sl = self._handle(shard).get_slice(self._stored.get(name, name))
            return sl.get_dtype(), tuple(sl.get_shape())
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{shard}: cannot read tensor {name!r} ({e})") from e

    def check_experts(self):
        """Every routed expert present with the shapes its format needs — from the headers, before any
        token runs, so that a broken expert is not found only when a prompt happens to route to it."""
        c = self.config
        L, I = c.moe_input_size, c.moe_intermediate_size
        for layer in c.moe_layers:
            for e in range(c.n_routed_experts):
                for proj, (o, i) in (("up", (I, L)), ("down", (L, I))):
                    m = self.expert_module(layer, e, proj)
                    dt, shape = self.info(m + ".weight")
                    want = {"U8": (o, i // 2), "F8_E4M3": (o, i)}.get(dt, (o, i))
                    if shape != want:
                        raise CheckpointError(f"{self.shard_of(m + '.weight')}: {m}.weight has shape {shape}, "
                                              f"expected {want} ({dt})")
                    if dt == "U8":
                        sdt, sshape = self.info(m + ".weight_scale")
                        if sshape != (o, i // 16) or sdt not in ("F8_E4M3", "U8"):
                            raise CheckpointError(f"{self.shard_of(m + '.weight_scale')}: {m}.weight_scale is "
                                                  f"{sdt} {sshape}, expected F8_E4M3 {(o, i // 16)}")
                        self.info(m + ".weight_scale_2")

    def get_float(self, name: str, shape: tuple | None = None) -> torch.Tensor:
        """A non-quantized tensor (norm, bias, A_log, ...): any float dtype accepted, shape checked."""
        t = self.get(name)
        if t.dtype not in _FLOAT_DTYPES:
            raise CheckpointError(f"{self.shard_of(name)}: {name} has dtype {t.dtype}, expected a float tensor")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{self.shard_of(name)}: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        return t

    def _scalar(self, name: str) -> torch.Tensor:
        t = self.get(name)
        if t.numel() != 1:
            raise CheckpointError(f"{self.shard_of(name)}: {name} has shape {tuple(t.shape)}, expected a scalar")
        return t.reshape(()).to(torch.float32)

    # ------------------------------------------------------------------ linears
    def detect_format(self, module: str) -> str:
        wname = module + ".weight"
        w = self.get(wname)
        if w.dtype == torch.uint8:
            if not self.has(module + ".weight_scale") or not self.has(module + ".weight_scale_2"):
                raise CheckpointError(f"{self.shard_of(wname)}: {wname} is packed U8 (NVFP4) but "
                                      f"{module}.weight_scale / .weight_scale_2 are missing")
            return "nvfp4"
        if w.dtype == torch.float8_e4m3fn:
            if not self.has(module + ".weight_scale"):
                raise CheckpointError(f"{self.shard_of(wname)}: {wname} is F8_E4M3 but {module}.weight_scale is missing")
            return "fp8"
        if w.dtype in _FLOAT_DTYPES:
            return "dense"
        raise CheckpointError(f"{self.shard_of(wname)}: {wname} has unsupported dtype {w.dtype}")

    def linear(self, module: str, out_features: int, in_features: int) -> QuantizedWeight:
        fmt = self.detect_format(module)
        expected = self.quant.expected(module)
        if fmt != expected:
            if fmt == "dense" or expected == "dense" and fmt != "dense" and self.quant.algo != "MIXED_PRECISION":
                # The config's summary (exclude_modules) is a wildcard list that can miss modules;
                # the tensors themselves are unambiguous, so they decide.
                warnings.warn(f"{module}: quantization config says {expected}, tensors are {fmt}; using {fmt}",
                              stacklevel=2)
            else:
                raise CheckpointError(f"{self.shard_of(module + '.weight')}: {module} is stored as {fmt} but "
                                      f"{self.quant.source or 'the config'} says {expected}")
        wname = module + ".weight"
        w = self.get(wname)
        where = self.shard_of(wname)
        if fmt == "nvfp4":
            if in_features % 16:
                raise CheckpointError(f"{where}: {module} in_features={in_features} is not a multiple of 16")
            s = self.get(module + ".weight_scale")
            if s.dtype == torch.uint8:
                s = s.view(torch.float8_e4m3fn)
            _check_shape(where, wname, w, (out_features, in_features // 2), "U8")
            _check_shape(where, module + ".weight_scale", s, (out_features, in_features // 16), "F8_E4M3")
            if s.dtype != torch.float8_e4m3fn:
                raise CheckpointError(f"{where}: {module}.weight_scale has dtype {s.dtype}, expected F8_E4M3")
            return QuantizedWeight("nvfp4", w, s, self._scalar(module + ".weight_scale_2"), out_features, in_features)
        _check_shape(where, wname, w, (out_features, in_features), "F8_E4M3" if fmt == "fp8" else "float")
        if fmt == "fp8":
            return QuantizedWeight("fp8", w, self._scalar(module + ".weight_scale"), None, out_features, in_features)
        return QuantizedWeight("dense", w, None, None, out_features, in_features)

    @staticmethod
    def expert_module(layer: int, expert: int, proj: str) -> str:
        if proj not in ("up", "down"):
            raise ValueError(proj)
        return f"backbone.layers.{layer}.mixer.experts.{expert}.{proj}_proj"

    def expert_weights(self, layer: int, expert: int) -> tuple[QuantizedWeight, QuantizedWeight]:
        c = self.config
        up = self.linear(self.expert_module(layer, expert, "up"), c.moe_intermediate_size, c.moe_input_size)
        down = self.linear(self.expert_module(layer, expert, "down"), c.moe_input_size, c.moe_intermediate_size)
        return up, down

    def close(self):
        self._handles.clear()


def _check_shape(where, name, t, shape, what):
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"{where}: {name} has shape {tuple(t.shape)}, expected {tuple(shape)} ({what})")
