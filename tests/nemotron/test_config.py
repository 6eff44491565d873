import json
import math

import pytest

from nemotron.config import ConfigError, NemotronHConfig

HUB = {
    "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "hidden_size": 64,
    "hybrid_override_pattern": "MEM*E-", "num_hidden_layers": 6, "mamba_num_heads": 8, "mamba_head_dim": 16,
    "n_groups": 2, "ssm_state_size": 16, "n_routed_experts": 16, "num_experts_per_tok": 4,
    "moe_latent_size": 32, "num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E",
}


def test_hub_and_saved_forms_agree():
    hub = NemotronHConfig.from_dict(HUB)
    saved = dict(HUB)
    del saved["hybrid_override_pattern"], saved["num_hidden_layers"], saved["mtp_hybrid_override_pattern"]
    saved["layers_block_type"] = ["linear_attention", "moe", "mamba", "full_attention", "moe", "mlp"]
    saved["mtp_layers_block_type"] = ["full_attention", "moe"]
    saved["time_step_limit"] = [0.0, {"__float__": "Infinity"}]
    s = NemotronHConfig.from_dict(json.loads(json.dumps(saved)))
    assert hub.layer_types == s.layer_types == ["mamba", "moe", "mamba", "attention", "moe", "mlp"]
    assert s.time_step_limit == (0.0, math.inf) == hub.time_step_limit
    assert hub.mtp_layer_types == s.mtp_layer_types == ["attention", "moe"]
    assert hub.config_hash() == s.config_hash()
    assert hub.moe_layers == [1, 4] and hub.pattern == "MEM*E-" and hub.moe_input_size == 32


def test_legacy_aliases():
    d = dict(HUB)
    d.pop("n_groups")
    d.update(mamba_n_groups=4, mamba_d_conv=3, mamba_chunk_size=32, mamba_dt_limit=[0.01, 5.0])
    c = NemotronHConfig.from_dict(d)
    assert (c.n_groups, c.conv_kernel, c.chunk_size, c.time_step_limit) == (4, 3, 32, (0.01, 5.0))


def test_hash_changes_with_shape():
    a = NemotronHConfig.from_dict(HUB)
    b = NemotronHConfig.from_dict(dict(HUB, n_routed_experts=32))
    assert a.config_hash() != b.config_hash()


@pytest.mark.parametrize("patch, msg", [
    ({"hybrid_override_pattern": "MEX"}, "unknown layer type 'X' at position 2"),
    ({"num_hidden_layers": 7}, "num_hidden_layers=7"),
    ({"model_type": "llama"}, "model_type"),
    ({"mlp_hidden_act": "gelu"}, "relu2"),
    ({"n_groups": 3}, "n_groups"),
])
def test_bad_configs(patch, msg):
    with pytest.raises(ConfigError, match=msg):
        NemotronHConfig.from_dict(dict(HUB, **patch))


def test_unknown_layer_name_in_list():
    d = dict(HUB)
    del d["hybrid_override_pattern"]
    d["layers_block_type"] = ["mamba", "sliding"]
    with pytest.raises(ConfigError, match="'sliding'"):
        NemotronHConfig.from_dict(d)


def test_from_dir_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        NemotronHConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ConfigError, match="not valid JSON"):
        NemotronHConfig.from_dir(tmp_path)
