"""NemotronH config: both forms that exist on disk.

The hub's config.json carries `hybrid_override_pattern` (M/E/*/-), `num_hidden_layers` and sometimes legacy
`mamba_*` names; transformers' `save_pretrained` writes `layers_block_type` (a list) and encodes infinity as
`{"__float__": "Infinity"}`. Both parse to the same `NemotronHConfig`.

A vision-language (Omni / VL) config.json nests the language model's config under `llm_config` (released files)
or `text_config` (transformers' `save_pretrained`); that nested dict is parsed, and the whole file is kept in
`multimodal` for the vision side.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

MAMBA, ATTENTION, MOE, MLP = "mamba", "attention", "moe", "mlp"
_PATTERN_CHARS = {"M": MAMBA, "*": ATTENTION, "E": MOE, "-": MLP}
_LAYER_NAMES = {
    "mamba": MAMBA, "linear_attention": MAMBA, "m": MAMBA,
    "attention": ATTENTION, "full_attention": ATTENTION,
    "moe": MOE, "mlp": MLP,
}
_LEGACY_ALIASES = {
    "mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max", "mamba_dt_limit": "time_step_limit",
    "mamba_dt_init_floor": "time_step_floor", "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size", "mamba_n_heads": "mamba_num_heads", "mamba_d_head": "mamba_head_dim",
    "mamba_d_state": "ssm_state_size", "n_experts": "n_routed_experts", "num_local_experts": "n_routed_experts",
    "norm_eps": "layer_norm_epsilon",
}
# where a vision-language config.json keeps the language model's config (released name first)
TEXT_CONFIG_KEYS = ("llm_config", "text_config")


class ConfigError(ValueError):
    pass


@dataclass
class NemotronHConfig:
    layer_types: list[str]
    vocab_size: int = 131072
    hidden_size: int = 4096
    # attention
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    attention_bias: bool = False
    # mamba2
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    chunk_size: int = 128
    use_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    # dense MLP layers
    intermediate_size: int = 21504
    mlp_bias: bool = False
    mlp_hidden_act: str = "relu2"
    # moe
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # misc
    layer_norm_epsilon: float = 1e-5
    residual_in_fp32: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = 0
    torch_dtype: str = "bfloat16"
    # multi-token prediction (parsed, not run yet)
    num_nextn_predict_layers: int = 0
    mtp_layer_types: list[str] = field(default_factory=list)
    raw: dict = field(default_factory=dict, repr=False)
    multimodal: dict | None = field(default=None, repr=False)   # the whole config.json of an Omni / VL checkpoint

    # -------------------------------------------------------------- derived
    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.mamba_intermediate + 2 * self.n_groups * self.ssm_state_size

    @property
    def moe_input_size(self) -> int:
        return self.moe_latent_size or self.hidden_size

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == MOE]

    @property
    def pattern(self) -> str:
        inv = {v: k for k, v in _PATTERN_CHARS.items()}
        return "".join(inv[t] for t in self.layer_types)

    def config_hash(self) -> str:
        """A stable hash of everything that decides tensor shapes and math (not tokenizer or dtype names)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("raw", "multimodal", "torch_dtype")}
        d["time_step_limit"] = [repr(float(x)) for x in self.time_step_limit]
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]

    # -------------------------------------------------------------- parsing
    @classmethod
    def from_dict(cls, d: dict) -> "NemotronHConfig":
        d = _decode_special_floats(dict(d))
        if d.get("model_type") != "nemotron_h":
            nested = [k for k in TEXT_CONFIG_KEYS if isinstance(d.get(k), dict)]
            if nested:
                try:
                    cfg = cls.from_dict(d[nested[0]])
                except ConfigError as e:
                    raise ConfigError(f"{nested[0]}: {e}") from e
                cfg.multimodal = d
                return cfg
        for old, new in _LEGACY_ALIASES.items():
            if old in d and new not in d:
                d[new] = d[old]
        mt = d.get("model_type")
        if mt is not None and mt != "nemotron_h":
            raise ConfigError(f"model_type is {mt!r}, expected 'nemotron_h'")
        layer_types = _parse_layer_types(d.get("layers_block_type"), d.get("hybrid_override_pattern"), "layers")
        n = d.get("num_hidden_layers")
        if d.get("layers_block_type") is None and n is not None and n != len(layer_types):
            raise ConfigError(
                f"num_hidden_layers={n} but hybrid_override_pattern has {len(layer_types)} layers")
        mtp = d.get("mtp_layers_block_type")
        if mtp is None and d.get("mtp_hybrid_override_pattern"):
            mtp = d["mtp_hybrid_override_pattern"]
        mtp_types = _parse_layer_types(mtp if isinstance(mtp, list) else None,
                                       mtp if isinstance(mtp, str) else None, "mtp layers", required=False)
        kw = {}
        names = {f.name for f in fields(cls)} - {"layer_types", "mtp_layer_types", "raw", "multimodal"}
        for name in names:
            if name in d and d[name] is not None:
                kw[name] = d[name]
        if "torch_dtype" not in d and "dtype" in d:
            kw["torch_dtype"] = d["dtype"]
        tsl = d.get("time_step_limit")
        kw["time_step_limit"] = (0.0, math.inf) if tsl is None else (float(tsl[0]), float(tsl[1]))
        if d.get("moe_latent_size") is None:
            kw["moe_latent_size"] = None
        cfg = cls(layer_types=layer_types, mtp_layer_types=mtp_types, raw=d, **kw)
        cfg._validate()
        return cfg

    @classmethod
    def from_dir(cls, model_dir) -> "NemotronHConfig":
        path = Path(model_dir) / "config.json"
        if not path.exists():
            raise ConfigError(f"{path}: no config.json in the model directory")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        try:
            return cls.from_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e

    def _validate(self):
        if self.mamba_num_heads % self.n_groups:
            raise ConfigError(f"mamba_num_heads={self.mamba_num_heads} is not a multiple of n_groups={self.n_groups}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads is not a multiple of num_key_value_heads")
        if MOE in self.layer_types:
            if self.n_routed_experts % self.n_group:
                raise ConfigError(f"n_routed_experts={self.n_routed_experts} not divisible by n_group={self.n_group}")
            if self.topk_group > self.n_group:
                raise ConfigError("topk_group > n_group")
            if self.num_experts_per_tok > self.n_routed_experts:
                raise ConfigError("num_experts_per_tok > n_routed_experts")
        if self.mlp_hidden_act != "relu2":
            raise ConfigError(f"mlp_hidden_act={self.mlp_hidden_act!r}: only relu2 is supported")

    @property
    def eos_token_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else ([e] if isinstance(e, int) else list(e))


def _decode_special_floats(obj):
    if isinstance(obj, dict):
        if set(obj) == {"__float__"}:
            return float(obj["__float__"])
        return {k: _decode_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode_special_floats(v) for v in obj]
    return obj


def _parse_layer_types(lst, pattern, what, required=True) -> list[str]:
    if lst is not None:
        out = []
        for i, name in enumerate(lst):
            t = _LAYER_NAMES.get(str(name).lower())
            if t is None:
                raise ConfigError(f"unknown layer type {name!r} at {what}[{i}] (known: {sorted(_LAYER_NAMES)})")
            out.append(t)
        return out
    if pattern is not None:
        out = []
        for i, ch in enumerate(pattern):
            t = _PATTERN_CHARS.get(ch)
            if t is None:
                raise ConfigError(f"unknown layer type {ch!r} at position {i} of pattern {pattern!r} "
                                  "(known: M mamba, * attention, E moe, - mlp)")
            out.append(t)
        return out
    if required:
        raise ConfigError("neither layers_block_type nor hybrid_override_pattern is set")
    return []
