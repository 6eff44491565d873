"""The device-side co-activation order (tools.coactivation's batched functions) and the one-call measurement
tools.instrument_downbytes: exactness of the in-memory BF16 order with its must-fail twin, the swap gains
against a brute-force recount, the batched order on planted clusters, and the command end to end on a
seconds-long CPU run."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgpack
import numpy as np
import torch

from tools.coactivation import batched_order, batched_refine, batched_unions, coactivation_order, swap_gains
from tools.instrument_downbytes import permute_experts_, round_to_hub_bf16_
from tools.instrument_model import InstrumentLM
from tools.train_instrument import PRESETS

DATA = Path(__file__).resolve().parents[1] / "data"
TINY = DATA / "instrument-tiny"
HELDOUT = DATA / "instrument-heldout.txt"


def _model(seed=0):
    """The test preset with experts scaled up, so that the routed output moves the logits (at the init's
    0.02 the residual stream hides a wrong expert)."""
    torch.manual_seed(seed)
    m = InstrumentLM(PRESETS["test"])
    m.init_weights(seed)
    with torch.no_grad():
        for moe in m.moes():
            moe.up.mul_(8)
            moe.down.mul_(30)
    round_to_hub_bf16_(m)
    return m.eval()


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _random_perms(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {j: torch.stack([torch.randperm(m.up.shape[1], generator=g) for _ in range(m.E)])
            for j, m in enumerate(model.moes())}


def test_bf16_order_is_exact_and_the_twin_is_caught():
    m = _model()
    ids = torch.randint(0, m.cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = m(ids)
    perms = _random_perms(m)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    permute_experts_(m, perms)
    with torch.no_grad():
        got = m(ids)
    assert _rel(got, ref) < 1e-6
    m.load_state_dict(state)
    permute_experts_(m, perms, permute_down=False)     # must-fail twin: up rows move, down columns do not
    with torch.no_grad():
        bad = m(ids)
    assert _rel(bad, ref) > 1e-2


def _planted(E=3, T=240, n=32, clusters=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(E, T, clusters, generator=g) < 0.2
    f = base.repeat_interleave(n // clusters, -1) & (torch.rand(E, T, n, generator=g) < 0.9)
    shuffle = torch.stack([torch.randperm(n, generator=g) for _ in range(E)])
    return torch.gather(f, 2, shuffle[:, None, :].expand(E, T, n))


def _brute_gains(F: torch.Tensor, size: int) -> torch.Tensor:
    T, n = F.shape

    def unions(x):
        return int(x.view(T, -1, size).amax(-1).sum())
    u0 = unions(F)
    out = torch.zeros(n, n)
    for i in range(n):
        for j in range(n):
            x = F.clone()
            x[:, [i, j]] = x[:, [j, i]]
            out[i, j] = unions(x) - u0
    return out


def test_swap_gains_equal_a_brute_force_recount():
    f = _planted(E=1, T=120, n=16, clusters=4).float()
    size = 4
    grp = torch.arange(16) // size
    other = grp[:, None] != grp[None, :]
    brute = _brute_gains(f[0], size)
    assert torch.equal(swap_gains(f, size)[0][other], brute[other])
    # must-fail twin: the gains of another grouping are not this grouping's
    assert not torch.equal(swap_gains(f, 8)[0][other], brute[other])


def test_batched_order_finds_planted_clusters_and_is_a_permutation():
    f = _planted()
    E, T, n = f.shape
    ident = torch.arange(n).expand(E, n).contiguous()
    perm, info = batched_order(f, (8, 4, 2))
    assert all(sorted(p.tolist()) == list(range(n)) for p in perm)
    # each 8-group is one planted cluster: its union is the cluster's own firing tokens
    planted_best = sum(int(f[e][:, perm[e][g * 8:(g + 1) * 8]].any(-1).sum()) for e in range(E) for g in range(4))
    assert int(batched_unions(f, perm, 8).sum()) == planted_best
    assert int(batched_unions(f, perm, 8).sum()) < 0.7 * int(batched_unions(f, ident, 8).sum())
    # no worse than the one-expert-at-a-time CPU order on the same calibration
    cpu = torch.stack([coactivation_order(f[e], levels=(8, 4, 2)) for e in range(E)])
    for n_ in (8, 4, 2):
        assert int(batched_unions(f, perm, n_).sum()) <= int(batched_unions(f, cpu, n_).sum())


def test_batched_refine_keeps_the_coarser_groups_and_never_adds_unions():
    g = torch.Generator().manual_seed(5)
    f = torch.rand(4, 200, 64, generator=g) < 0.1
    ident = torch.arange(64).expand(4, 64).contiguous()
    perm, _ = batched_refine(f, ident, 4, parent=16)
    for e in range(4):
        for b in range(4):
            assert set(perm[e, b * 16:(b + 1) * 16].tolist()) == set(range(b * 16, (b + 1) * 16))
    assert bool((batched_unions(f, perm, 4) <= batched_unions(f, ident, 4)).all())
    assert int(batched_unions(f, perm, 4).sum()) < int(batched_unions(f, ident, 4).sum())


def test_the_one_call_measurement_end_to_end_on_cpu(tmp_path):
    from tools.instrument_downbytes import main
    from tools.ppl import text_ids
    from tools.synth_tokenizer import write_tokenizer_files
    data = tmp_path / "corpus"
    (data / "tokenizer").mkdir(parents=True)
    write_tokenizer_files(data / "tokenizer", (TINY / "tokenizer.json").read_text())
    ids = np.asarray(text_ids(TINY, HELDOUT), dtype="<u2")
    ids.tofile(data / "train.u16")
    ids[:1500].tofile(data / "heldout.u16")
    shutil.copy(HELDOUT, data / "heldout.txt")
    out = tmp_path / "out"
    assert main(["--data", str(data), "--out", str(out), "--preset", "test", "--device", "cpu", "--seconds", "30",
                 "--seq-len", "64", "--calib-tokens", "512", "--heldout-tokens", "256", "--trace-tokens", "300",
                 "--realize", "coact4", "--max-steps", "2", "--batch-tokens", "128", "--eval-windows", "1",
                 "--final-eval-windows", "1"]) == 0
    res = json.loads((out / "downbytes.json").read_text())
    ex = res["exactness"]
    assert ex["bf16 coact-ordered"]["max_rel_logit_diff"] < 1e-6
    assert ex["nvfp4 from unordered"]["kl_mean"] > 0 and ex["nvfp4 from coact4-ordered"]["kl_mean"] > 0
    nv = res["bytes"]["nvfp4"]["vs_unordered_16"]
    assert nv["identity"]["16"] == 1.0 and set(nv) >= {"frequency", "coact", "coact4", "coact4 (ordered model)"}
    # the ordered BF16 model's own masks are the unordered masks under the order
    bf = res["bytes"]["bf16_ordered_model"]["bytes_per_token"]
    assert bf["coact (ordered model)"] == res["bytes"]["bf16"]["bytes_per_token"]["coact"]
    with open(out / "routing-instrument-main.msgpack", "rb") as f:
        recs = list(msgpack.Unpacker(f))
    cfg = PRESETS["test"]
    n_moe = cfg.pattern.count("E")
    assert len(recs) == res["trace"]["tokens"] * n_moe > 0
    assert all(len(r[2]) == len(r[3]) == cfg.num_experts_per_tok and r[4] == [] for r in recs)


def test_in_memory_nvfp4_is_the_hub_nvfp4_checkpoint(tmp_path):
    import copy

    from tools.instrument_downbytes import quantize_nvfp4_
    from tools.instrument_hub import load_checkpoint, write_checkpoint
    m = _model()
    write_checkpoint(m, tmp_path / "nvfp4", "nvfp4", TINY)
    hub = load_checkpoint(tmp_path / "nvfp4").state_dict()
    q = copy.deepcopy(m)
    assert quantize_nvfp4_(q) > 0
    for k, v in q.state_dict().items():
        assert torch.equal(v.float(), hub[k].float()), k
    # must-fail twin: the BF16 values are not the NVFP4 checkpoint's
    assert not all(torch.equal(v.float(), hub[k].float()) for k, v in m.state_dict().items())


def test_order_the_bf16_master_then_quantize_on_disk(tmp_path):
    """The offline exact path: tools.coactivation on the BF16 checkpoint, then tools.instrument_hub quantizes it;
    equal to the in-memory path of tools.instrument_downbytes (order, then quantize_nvfp4_)."""
    import copy

    from safetensors.torch import load_file

    from tools.coactivation import order_checkpoint
    from tools.instrument_downbytes import quantize_nvfp4_
    from tools.instrument_hub import load_checkpoint, main, write_checkpoint
    from tools.ppl import text_ids
    m = _model()
    write_checkpoint(m, tmp_path / "bf16", "bf16", TINY)
    ids = text_ids(TINY, HELDOUT)[:200]
    s = order_checkpoint(tmp_path / "bf16", ids, tmp_path / "ordered", "coactivation")
    assert s["requantized_down"] == 0
    assert main(["--model", str(tmp_path / "ordered"), "--out", str(tmp_path / "nvfp4")]) == 0
    perms = {j: torch.stack([torch.tensor(s["perms"][f"{layer}.{e}"]) for e in range(moe.E)])
             for j, (layer, moe) in enumerate(zip([i for i, c in enumerate(m.cfg.pattern) if c == "E"], m.moes()))}
    q = copy.deepcopy(m)
    permute_experts_(q, perms)
    quantize_nvfp4_(q)
    disk = load_checkpoint(tmp_path / "nvfp4").state_dict()
    for k, v in q.state_dict().items():
        assert torch.equal(v.float(), disk[k].float()), k
    # must-fail twin: quantizing the unordered master is another checkpoint
    assert main(["--model", str(tmp_path / "bf16"), "--out", str(tmp_path / "nvfp4-unordered")]) == 0
    a = load_file(str(next((tmp_path / "nvfp4").glob("model-00002-*.safetensors"))))
    b = load_file(str(next((tmp_path / "nvfp4-unordered").glob("model-00002-*.safetensors"))))
    assert any(not torch.equal(a[k], b[k]) for k in a if ".experts." in k)
    # and an NVFP4 checkpoint is refused (re-encoding it would be the lossy path)
    assert main(["--model", str(tmp_path / "nvfp4"), "--out", str(tmp_path / "again")]) == 1


def test_route_replay_keeps_the_recorded_experts_and_flips_are_counted():
    from tools.instrument_downbytes import RouteReplay, routing_flips
    m = _model()
    ids = torch.randint(0, m.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(4))
    rec = RouteReplay()
    with rec, torch.no_grad():
        rec.mode = "record"
        m(ids)
    with torch.no_grad():
        m.moes()[0].gate.add_(torch.randn_like(m.moes()[0].gate))     # another router: other choices
    changed = RouteReplay()
    with changed, torch.no_grad():
        changed.mode = "record"
        m(ids)
    assert routing_flips(rec.log, changed.log)["rows_differing"] > 0      # the counter sees a changed router
    seen, replayed = [], rec._route

    def spy(*a):
        idx, w = replayed(*a)
        seen.append(idx)
        return idx, w
    rec._route = spy
    with rec, torch.no_grad():
        rec.mode, rec.i = "replay", 0
        m(ids)
    assert len(seen) == len(rec.log)
    assert routing_flips(rec.log, seen)["rows_differing"] == 0           # replayed: the recorded experts
    assert routing_flips(rec.log, rec.log)["rows"] == 2 * 40 * len(m.moes())
