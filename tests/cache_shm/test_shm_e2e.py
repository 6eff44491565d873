"""End to end with real processes (prefetcher + IO workers) on a fake store."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from cache_shm.client import ExpertLoadError
from cache_shm.names import list_entries, pid_alive, sweep_stale
from cache_shm.shm import INF
from gpu_worker.cache_supervisor import Supervisor
from moestream_fake_store import make_fake_store
from tests.conftest import repo_env

REPO = Path(__file__).resolve().parents[2]


def wait_until(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def block_ok(store, view, layer, expert):
    return zlib.crc32(view) == int(store.checksums[layer, expert])


@pytest.fixture()
def run(tmp_path):
    """run(store=None, **supervisor kwargs) -> started Supervisor; all are stopped and checked."""
    sups = []

    def start(store=None, **kw):
        store = store or make_fake_store(tmp_path / f"s{len(sups)}", n_layers=4, n_experts=32)
        kw.setdefault("n_workers", 2)
        sup = Supervisor(store, **kw).start()
        sups.append(sup)
        return sup
    yield start
    for sup in sups:
        pids = sup.child_pids()
        sup.stop()
        assert list_entries(sup.prefix) == [], "shared memory left behind"
        assert not [p for p in pids if pid_alive(p)], "child process left behind"


def test_every_requested_block_lands_intact(run):
    sup = run(n_slots=128)
    c, st = sup.client(), sup.store
    for layer in range(4):
        c.request(layer, range(32))
        got = dict(c.wait_any(layer, range(32), timeout=20))
        assert sorted(got) == list(range(32))
        for e, s in got.items():
            assert bytes(c.view(s)) == st.block(layer, e), f"layer {layer} expert {e}"
        c.release(list(got.values()))
    hits = c.lookup(2, range(32))
    assert len(hits) == 32
    c.release(list(hits.values()))
    s = c.stats()
    assert s["demand_reads"] == 128 and s["io_reads"] == 128 and s["io_failures"] == 0
    assert s["io_bytes_read"] >= 128 * st.block_bytes
    assert (sup.shm.slot_pins == 0).all()


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_stress_small_cache_pinned_slot_survives(run, policy):
    sup = run(n_slots=13, policy=policy)           # ~10 % of 128 experts
    c, st, shm = sup.client(), sup.store, sup.shm
    c.request(0, [7])
    pinned = c.wait(0, 7, timeout=10)               # held for the whole run
    rng = np.random.default_rng(1)
    for step in range(120):
        layer = step % 4
        actual = rng.choice(32, 4, replace=False)
        guess = rng.choice(32, 3, replace=False)
        hits = c.lookup(layer, actual)
        c.request(layer, actual, guess)
        misses = [e for e in actual.tolist() if e not in hits]
        got = dict(hits)
        got.update(c.wait_any(layer, misses, timeout=20))
        for e, s in got.items():                    # every slot handed out holds exactly its block
            assert block_ok(st, c.view(s), layer, e), f"step {step}: layer {layer} expert {e} slot {s}"
        c.release(list(got.values()))
    assert shm.slot_key[pinned] == 0 * 32 + 7 and shm.slot_of_expert[0, 7] == pinned
    assert bytes(c.view(pinned)) == st.block(0, 7)
    c.release(pinned)
    s = c.stats()
    assert s["evictions"] > 50 and s["prefetch_issued"] > 0 and s["io_failures"] == 0
    assert s["prefetch_used"] + s["prefetch_wasted"] <= s["prefetch_issued"]
    assert s["lookup_hits"] + s["lookup_misses"] == 120 * 4


def test_demand_reads_go_before_prefetch_reads(run):
    sup = run(n_slots=40, n_workers=1, worker_args=("--fault-delay-ms", "40"))
    c, shm = sup.client(), sup.shm
    c.request(0, [], guess=list(range(10)), guess_layer=1)     # 10 prefetch reads for layer 1
    wait_until(lambda: c.stats()["prefetch_issued"] > 0, 10, "the prefetcher to queue them")
    c.request(2, [5])                                          # then one demand read
    s = c.wait(2, 5, timeout=10)
    landed_before = int((shm.slot_state[shm.slot_of_expert[1][shm.slot_of_expert[1] >= 0]] == 2).sum())
    assert landed_before <= 2, f"{landed_before} prefetch reads landed before the demand read"
    c.release(s)
    wait_until(lambda: int((shm.slot_of_expert[1] >= 0).sum()) == 10 and
               int((shm.slot_state[shm.slot_of_expert[1][:10]] == 2).sum()) == 10, 10, "prefetches")
    st = c.stats()
    assert st["prefetch_issued"] == 10 and st["io_prefetch_reads"] == 10 and st["io_demand_reads"] == 1


def test_corrupted_block_is_failed_with_reason(run, tmp_path):
    store = make_fake_store(tmp_path / "bad", n_layers=2, n_experts=8)
    store.corrupt(1, 3)
    sup = run(store, n_slots=16)
    c = sup.client()
    c.request(1, [2, 3])
    s2 = c.wait(1, 2, timeout=10)
    assert bytes(c.view(s2)) == store.block(1, 2)
    with pytest.raises(ExpertLoadError, match=r"layer 1 expert 3: checksum mismatch: crc32 [0-9a-f]{8}, manifest"):
        c.wait(1, 3, timeout=10)
    assert c.stats()["io_failures"] == 1 and 3 not in c.lookup(1, [3])


def test_corrupted_block_undetected_without_checksums(run, tmp_path):
    """The must-fail twin: with checksums off the same corruption is served as if fine."""
    store = make_fake_store(tmp_path / "bad", n_layers=2, n_experts=8)
    store.corrupt(1, 3)
    sup = run(store, n_slots=16, verify_checksums=False)
    c = sup.client()
    c.request(1, [3])
    s = c.wait(1, 3, timeout=10)
    assert not block_ok(store, c.view(s), 1, 3)
    c.release(s)


def test_truncated_and_missing_store_fail_clearly(run, tmp_path):
    store = make_fake_store(tmp_path / "trunc", n_layers=1, n_experts=8)
    last = int(np.argmax(store.offsets[0]))
    os.truncate(store.experts_path, int(store.offsets[0, last]) + 1000)
    sup = run(store, n_slots=8)
    c = sup.client()
    c.request(0, [last])
    with pytest.raises(ExpertLoadError, match=r"short read: \d+ of \d+ bytes .*store truncated"):
        c.wait(0, last, timeout=10)
    gone = make_fake_store(tmp_path / "gone", n_layers=1, n_experts=4)
    os.unlink(gone.experts_path)
    c2 = run(gone, n_slots=4, n_workers=1).client()
    c2.request(0, [1])
    with pytest.raises(ExpertLoadError, match="cannot open store file .*experts.bin"):
        c2.wait(0, 1, timeout=10)


def test_io_worker_killed_mid_read_is_restarted(run):
    sup = run(n_slots=16, n_workers=1, worker_args=("--fault-delay-ms", "300"))
    c, shm, st = sup.client(), sup.shm, sup.store
    old = sup.workers[0].pid
    c.request(0, [4])
    wait_until(lambda: shm.inflight[0, INF["valid"]] == 1, 5, "the read to start")
    os.kill(old, signal.SIGKILL)
    s = c.wait(0, 4, timeout=15)          # the restarted worker finishes the killed one's read
    assert bytes(c.view(s)) == st.block(0, 4)
    assert sup.restarts["workers"] == 1 and sup.workers[0].pid != old and not pid_alive(old)
    c.request(1, [5])
    assert bytes(c.view(c.wait(1, 5, timeout=15))) == st.block(1, 5)


def test_prefetcher_killed_requests_still_complete(run):
    sup = run(n_slots=16, n_workers=2, worker_args=("--fault-delay-ms", "100"))
    c, st = sup.client(), sup.store
    old = sup.prefetcher.pid
    c.request(0, [1, 2, 3, 4, 5])
    os.kill(old, signal.SIGKILL)
    c.request(0, [6])
    got = dict(c.wait_any(0, [1, 2, 3, 4, 5, 6], timeout=20))
    for e, s in got.items():
        assert bytes(c.view(s)) == st.block(0, e)
    assert sorted(got) == [1, 2, 3, 4, 5, 6] and sup.restarts["prefetcher"] == 1
    assert c.stats()["epoch"] == 2


OWNER = textwrap.dedent("""
    import json, signal, sys
    sys.path.insert(0, {fake!r})
    from moestream_fake_store import make_fake_store
    from gpu_worker.cache_supervisor import Supervisor
    sup = Supervisor(make_fake_store({store!r}, n_layers=2, n_experts=8), n_slots=8, n_workers=2).start()
    c = sup.client()
    c.request(0, [1])
    c.wait(0, 1, timeout=10)
    print(json.dumps(dict(prefix=sup.prefix, pids=sup.child_pids())), flush=True)
    signal.pause()      # until the test's signal
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_owner_killed_leaves_no_process_and_no_shm(tmp_path, sig):
    script = tmp_path / "owner.py"
    script.write_text(OWNER.format(fake=str(Path(__file__).parent), store=str(tmp_path / "st")))
    env = repo_env()
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        info = json.loads(owner.stdout.readline())
    finally:
        owner.send_signal(sig)
        owner.wait(10)
    wait_until(lambda: not [p for p in info["pids"] if pid_alive(p)], 10, "children to exit")
    if sig == signal.SIGTERM:
        assert list_entries(info["prefix"]) == []     # the owner cleaned up itself
    else:
        assert list_entries(info["prefix"])           # nobody could; the next start sweeps
        sweep_stale()
        assert list_entries(info["prefix"]) == []


def test_client_in_another_process(run):
    """The compute process is not the owner: it attaches by prefix and unlinks nothing."""
    sup = run(n_slots=16)
    code = textwrap.dedent(f"""
        import zlib
        from cache_shm.client import CacheClient
        c = CacheClient.attach({sup.prefix!r})
        c.request(3, [9, 10])
        got = dict(c.wait_any(3, [9, 10], timeout=10))
        print(*[zlib.crc32(c.view(s)) for e, s in sorted(got.items())])
        c.release(list(got.values()))
        c.close()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env=repo_env(), timeout=30)
    assert out.returncode == 0, out.stderr
    assert [int(x) for x in out.stdout.split()] == [int(sup.store.checksums[3, 9]), int(sup.store.checksums[3, 10])]
    assert len(list_entries(sup.prefix)) == 2 + 2 + 2
    assert (sup.shm.slot_pins == 0).all()
