"""Down sub-groups as a store option (`--down-group-neurons N`): recorded in the manifest, proven by
`--verify` (which catches a sub-group with a wrong scale copy: the must-fail twin), and the streaming
engine's logits from a sub-grouped store equal the plain store's (fp32, ≤ 1e-6 relative) and transformers'."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from expert_store.format import MANIFEST_NAME, StoreError, VerifyError, read_manifest, write_manifest
from expert_store.layout import block_crc
from expert_store.reader import ExpertStore
from expert_store.verify import verify
from tools import repack as cli

N_DECODE = 6


@pytest.fixture(scope="module")
def model(synth):
    return synth("tiny", "nvfp4")


@pytest.fixture(scope="module")
def stores(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("sub")
    out = {}
    for n in (16, 4, 1):
        out[n] = root / f"n{n}"
        assert cli.main(["--model", str(model), "--out", str(out[n]), "--no-progress",
                         "--down-group-neurons", str(n)]) == 0
    return out


def test_manifest_records_the_group_size_and_verify_proves_it(model, stores, capsys):
    for n, d in stores.items():
        g = json.loads((d / MANIFEST_NAME).read_text())["geometry"]
        assert g["down_group_neurons"] == n
        s = ExpertStore.open(d)
        assert s.geometry.down_group_neurons == n and s.geometry.n_groups == 96 // n
        assert cli.main(["--verify", str(d), "--model", str(model), "--no-progress"]) == 0
    # finer groups cost disk: every sub-group carries L scale bytes again
    sizes = [ExpertStore.open(stores[n]).block_bytes for n in (16, 4, 1)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]


def test_bad_group_size_is_a_clear_error(model, tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["--model", str(model), "--out", str(tmp_path / "s"), "--down-group-neurons", "3"])
    assert "invalid choice: 3" in capsys.readouterr().err


def test_rerun_with_another_group_size_is_refused(model, stores, capsys):
    assert cli.main(["--model", str(model), "--out", str(stores[4]), "--no-progress",
                     "--down-group-neurons", "8"]) == 1
    assert "block geometry" in capsys.readouterr().err


def test_store_from_before_subgroups_opens_as_16(stores, tmp_path):
    d = tmp_path / "old"
    shutil.copytree(stores[16], d)
    m, arrays = read_manifest(d)
    del m["geometry"]["down_group_neurons"]
    write_manifest(d, m, arrays)
    assert ExpertStore.open(d).geometry.down_group_neurons == 16


def test_verify_catches_a_wrong_scale_copy(model, stores, tmp_path):
    """must-fail twin: sub-group 2 of 16-group 1 (n = 4) gets one scale byte changed and its checksum "fixed",
    so only the copy check can see it: the decode reads each 16-group's first copy, which is intact."""
    d = tmp_path / "bad"
    shutil.copytree(stores[4], d)
    s = ExpertStore.open(d)
    g = s.geometry
    j, e, sub, row = 1, 3, 1 * 4 + 2, 5
    off = int(s.offsets[j, e]) + g.down_groups.offset + sub * g.group_bytes + g.group_value_bytes + row
    with open(s.experts_path, "r+b") as f:
        f.seek(off)
        b = f.read(1)[0]
        f.seek(off)
        f.write(bytes([b ^ 0x08]))
    with pytest.raises(StoreError, match="checksum mismatch"):
        s.read_block(j, e)
    m, arrays = read_manifest(d)
    arrays["checksums"][j, e] = block_crc(s.read_block(j, e, check=False), g)
    write_manifest(d, m, arrays)
    with pytest.raises(VerifyError) as ei:
        verify(d, model, progress=False)
    msg = str(ei.value)
    assert f"expert {e})" in msg and "down sub-group 6 (neurons 24..27)" in msg and "group 1" in msg
    assert f"row {row}" in msg


def _logits(store, ids):
    """Logits of a pass over ids with every expert resident (a warm-up pass loads them), so the engine's
    expert sums are in routing order, not in the order misses land."""
    from gpu_worker.engine import StreamingEngine
    from tools.logits import logits_and_greedy
    s = ExpertStore.open(store)
    with StreamingEngine(store, cache_bytes=len(s.moe_layers) * s.n_experts * s.block_stride, io_workers=1) as eng:
        logits_and_greedy(eng.model, ids, N_DECODE)
        misses = eng.cache_stats()["lookup_misses"]
        out = logits_and_greedy(eng.model, ids, N_DECODE)
        assert eng.cache_stats()["lookup_misses"] == misses, "the measured pass had misses"
    return out


def _rel(a, b):
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


def test_subgrouped_store_gives_the_plain_store_logits(model, stores, tmp_path):
    from tests.nemotron.test_model_vs_transformers import mean_kl, reference
    ids = [int(t) for t in np.random.default_rng(5).integers(14, 500, size=20)]
    plain, plain_greedy, plain_gl = _logits(stores[16], ids)
    for n in (4, 1):
        logits, greedy, gl = _logits(stores[n], ids)
        np.testing.assert_array_equal(greedy, plain_greedy)
        assert _rel(logits, plain) <= 1e-6 and _rel(gl, plain_gl) <= 1e-6, (n, _rel(logits, plain), _rel(gl, plain_gl))
    hf_logits, hf_greedy, _ = reference(model, ids, N_DECODE, tmp_path)
    assert mean_kl(hf_logits, logits) < 1e-3
    np.testing.assert_array_equal(greedy, hf_greedy)
