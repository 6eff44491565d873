"""bench/coactivation.py on a BF16 synth checkpoint: the ordered model's output is the unordered one's (KL at
fp32 rounding), single-neuron counts do not depend on the order, and the table carries every order."""
import numpy as np
import torch

from bench.coactivation import kl_mean, next_token_nll, run, table


def test_kl_and_nll_are_what_they_say():
    g = torch.Generator().manual_seed(0)
    p = torch.randn(5, 11, generator=g)
    assert kl_mean(p, p) == 0.0 and kl_mean(p, p.roll(1, -1)) > 0
    ids = [0, 3, 7, 1, 2]
    want = -np.mean([torch.log_softmax(p[i].double(), -1)[ids[i + 1]].item() for i in range(4)])
    assert abs(next_token_nll(p, ids) - want) < 1e-12


def test_ordered_bf16_costs_nothing_and_keeps_single_neuron_counts(synth, tmp_path):
    model_dir = synth("tiny", "bf16")
    rng = np.random.default_rng(7)
    calib, held = ([int(t) for t in rng.integers(14, 1000, size=n)] for n in (48, 24))
    res = run(model_dir, calib, held, ["identity", "coactivation"], False, tmp_path)
    ident, co = res["orders"]
    assert ident["kl_mean"] == 0.0 and ident["down_vs_unordered_16"][16] == 1.0
    assert co["kl_mean"] < 1e-9 and co["greedy_agreement"] == 1.0 and co["max_rel_logit_diff"] <= 1e-5
    assert co["down_bytes_per_token"][1] == ident["down_bytes_per_token"][1]
    assert co["calib_groups_ratio"][16] < 1.0
    assert "coactivation" in table(res)
