"""bench/down_groups.py on a synth checkpoint: counting leaves the model's output alone, and the counts obey
what sub-groups are (each active 16-group has between 1 and 16/N active sub-groups)."""
import numpy as np
import torch

from bench.down_groups import CountingExperts, measure, table
from kernels.expert_block import DOWN_GROUP_NEURONS, ExpertGeometry
from nemotron.checkpoint import Checkpoint
from nemotron.model import NemotronH
from nemotron.moe import CheckpointExperts


def test_counting_is_transparent_and_counts_are_consistent(synth):
    model_dir = synth("tiny", "nvfp4")
    ids = [int(t) for t in np.random.default_rng(2).integers(14, 500, size=24)]
    plain = NemotronH(model_dir)
    src = CountingExperts(CheckpointExperts(Checkpoint(model_dir), "cpu"))
    counted = NemotronH(model_dir, experts=src)
    assert torch.equal(plain.forward(ids, plain.new_state()), counted.forward(ids, counted.new_state()))
    g16 = src.groups_read[16]
    cfg = Checkpoint(model_dir).config
    assert src.pairs == len(ids) * len(cfg.moe_layers) * cfg.num_experts_per_tok
    assert 0 < g16 < src.pairs * cfg.moe_intermediate_size // 16
    for n in DOWN_GROUP_NEURONS:
        assert g16 <= src.groups_read[n] <= g16 * (16 // n)

    res = measure(model_dir, ids)
    rows = {r["down_group_neurons"]: r for r in res["rows"]}
    for n, r in rows.items():
        g = ExpertGeometry(res["L"], res["I"], "nvfp4", n)
        assert abs(r["down_bytes_per_token"] - r["groups_read_per_token"] * g.group_bytes) < 1e-6 * r["down_bytes_per_token"]
        assert r["block_bytes"] == g.block_bytes
    assert [rows[n]["block_bytes"] for n in DOWN_GROUP_NEURONS] == sorted(rows[n]["block_bytes"]
                                                                           for n in DOWN_GROUP_NEURONS)
    assert rows[16]["down_vs_16"] == 1.0 and "groups/token" in table(res)
