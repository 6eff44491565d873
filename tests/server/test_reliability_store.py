"""A damaged expert store (issue 16.3): the first request that needs a flipped block fails with a clear error,
/health turns 503 naming the block and the command that proves it, /metrics counts the failure by its reason,
and no client sees the server's paths (the log has them). `--verify --sample` says what a sample cannot prove."""
from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.harness import ROOT, Launcher


def expert_store_class():
    from expert_store.reader import ExpertStore
    return ExpertStore


def repack(model, out):
    r = subprocess.run([sys.executable, "-m", "tools.repack", "--model", str(model), "--out", str(out),
                        "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def damaged(synth, tmp_path_factory):
    """A launcher on a store whose every block of the first MoE layer has one byte flipped (every prompt routes
    through that layer), and the output of a sampled verify of the store before the damage."""
    tmp = tmp_path_factory.mktemp("damaged")
    model, store = synth("tiny", "nvfp4"), tmp / "store"
    repack(model, store)
    sample = subprocess.run([sys.executable, "-m", "tools.repack", "--verify", str(store), "--model", str(model),
                             "--sample", "3", "--no-progress", "--skip-dense"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    st = expert_store_class().open(store)
    with open(st.experts_path, "r+b") as f:
        for e in range(st.n_experts):
            f.seek(int(st.offsets[0, e]) + 100)
            b = f.read(1)
            f.seek(int(st.offsets[0, e]) + 100)
            f.write(bytes([b[0] ^ 0xFF]))
    s = Launcher(model, "--store", str(store))
    s.start(tmp / "launcher.log")
    yield s, store, sample
    s.stop()


def failures(s) -> dict:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(s.url + "/metrics").text):
        for smp in fam.samples:
            if smp.name == "moestream_request_failures_total":
                out[(smp.labels["endpoint"], smp.labels["reason"])] = smp.value
    return out


def test_a_flipped_block_turns_health_to_503_after_one_request(damaged):
    s, store, _ = damaged
    assert s.health_seen[-1] == 200 and httpx.get(s.url + "/health").status_code == 200   # nothing read yet
    model = httpx.get(s.url + "/v1/models").json()["data"][0]["id"]
    r = httpx.post(s.url + "/v1/completions", json={"model": model, "prompt": "The fox", "max_tokens": 2},
                   timeout=120)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "store_damaged" and "checksum mismatch" in err["message"], err
    assert str(store) not in r.text and str(ROOT) not in r.text, err          # no server paths to the client
    h = httpx.get(s.url + "/health")
    assert h.status_code == 503, h.text
    msg = h.json()["error"]["message"]
    assert "expert store is damaged" in msg and "layer 0 expert" in msg and "(read twice)" in msg, msg
    assert "python -m tools.repack --verify STORE" in msg and str(store) not in msg, msg
    assert f"python -m tools.repack --verify {store}" in s.log()               # the log has the full command
    assert failures(s).get(("/v1/completions", "store_damaged"), 0) == 1, failures(s)


def test_a_sampled_verify_says_it_proves_nothing_about_the_rest(damaged):
    _, _, sample = damaged
    assert sample.returncode == 0, sample.stderr
    assert "OK: 3 blocks" in sample.stdout and "proves nothing about the others" in sample.stdout, sample.stdout
