"""bench.e2e_stream's A/B in one engine (`--ab-env`): each round decodes the same prompts without and with the
setting, in alternating order; the setting is on exactly for the b side and the environment is restored."""
import os

import pytest

from bench import e2e_stream


def test_alternated_pairs_with_the_setting_on_for_b_only(monkeypatch):
    monkeypatch.delenv("MOESTREAM_AB_PROBE", raising=False)
    calls = []

    def fake_run(eng, prompts, n_tokens, device):
        on = os.environ.get("MOESTREAM_AB_PROBE") == "1"
        calls.append((on, prompts))
        return dict(ms_per_token_all=[p + (9.0 if on else 10.0) for p in prompts],
                    disk_bytes_per_token=(50e6 if on else 60e6) + len(calls), hit_rate=0.9 if on else 0.8)
    monkeypatch.setattr(e2e_stream, "decode_run", fake_run)
    ab = e2e_stream.ab_in_engine(None, "MOESTREAM_AB_PROBE=1", 3, lambda k: [0.1 * k, 0.2 * k], 16, "cpu")
    # each arm's disk bytes a token and hit rate, by round, in its own list (the disk regime's A/B)
    assert ab["a_disk_mb"] == [60.0, 60.0, 60.0] and ab["b_disk_mb"] == [50.0, 50.0, 50.0]
    assert ab["a_hit"] == [0.8] * 3 and ab["b_hit"] == [0.9] * 3
    assert [on for on, _ in calls] == [False, True, True, False, False, True]     # a b, b a, a b
    assert [p for _, p in calls[0:2]] == [[0.0, 0.0]] * 2 and calls[2][1] == calls[3][1]   # the same prompts each way
    assert ab["diffs"] == [-1.0] * 6 and ab["b_median"] == pytest.approx(ab["a_median"] - 1.0)
    assert "MOESTREAM_AB_PROBE" not in os.environ


def test_the_setting_before_the_ab_comes_back(monkeypatch):
    monkeypatch.setenv("MOESTREAM_AB_PROBE", "7")
    seen = []
    monkeypatch.setattr(e2e_stream, "decode_run",
                        lambda *a: seen.append(os.environ.get("MOESTREAM_AB_PROBE")) or dict(ms_per_token_all=[1.0]))
    e2e_stream.ab_in_engine(None, "MOESTREAM_AB_PROBE=1", 2, lambda k: [k], 4, "cpu")
    assert seen == ["7", "1", "1", "7"] and os.environ["MOESTREAM_AB_PROBE"] == "7"
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        e2e_stream.ab_in_engine(None, "MOESTREAM_AB_PROBE", 2, lambda k: [k], 4, "cpu")


def test_three_arms_rotate_and_each_is_paired_with_a(monkeypatch):
    """Settings apart by ';' make arms b and c: each round decodes the same prompts in a rotated order (a b c, b c a,
    c a b), each arm with its own setting alone, and each gets its paired differences against a."""
    monkeypatch.delenv("MOESTREAM_AB_PROBE", raising=False)
    calls = []

    def fake_run(eng, prompts, n_tokens, device):
        v = os.environ.get("MOESTREAM_AB_PROBE")
        calls.append((v, prompts))
        return dict(ms_per_token_all=[p + {None: 10.0, "1": 9.0, "2": 12.0}[v] for p in prompts])
    monkeypatch.setattr(e2e_stream, "decode_run", fake_run)
    ab = e2e_stream.ab_in_engine(None, "MOESTREAM_AB_PROBE=1;MOESTREAM_AB_PROBE=2", 3, lambda k: [0.5 * k], 16, "cpu")
    assert [v for v, _ in calls] == [None, "1", "2", "1", "2", None, "2", None, "1"]
    assert all(calls[3 * r][1] == calls[3 * r + 2][1] for r in range(3))
    assert ab["diffs"] == [-1.0] * 3 and ab["diffs_c"] == [2.0] * 3 and ab["c_median"] == pytest.approx(12.5)
    assert "MOESTREAM_AB_PROBE" not in os.environ
    with pytest.raises(SystemExit, match="at most 7"):               # more arms than letters: named, none dropped
        e2e_stream.ab_in_engine(None, ";".join(f"MOESTREAM_AB_PROBE={i}" for i in range(8)), 1, lambda k: [k], 4, "cpu")


def test_the_disk_regimes_arms_decode_their_own_prompts(monkeypatch):
    """shared=False (the disk regime): each arm of a round gets its own prompts, so no arm finds the experts another
    arm's run of the same prompts has just read into the cache; the default (the twin) shares them within a round."""
    monkeypatch.delenv("MOESTREAM_AB_PROBE", raising=False)
    for shared in (False, True):
        seen = []
        monkeypatch.setattr(e2e_stream, "decode_run",
                            lambda eng, p, n, d: seen.append((os.environ.get("MOESTREAM_AB_PROBE"), p[0]))
                            or dict(ms_per_token_all=[1.0]))
        e2e_stream.ab_in_engine(None, "MOESTREAM_AB_PROBE=1;MOESTREAM_AB_PROBE=2", 2, lambda k: [k], 4, "cpu",
                                shared=shared)
        by_round = [{p for _, p in seen[3 * r:3 * r + 3]} for r in range(2)]
        if shared:
            assert by_round == [{0}, {1}]
        else:
            assert by_round == [{0, 1, 2}, {3, 4, 5}] and len({p for _, p in seen}) == 6


def test_the_timed_tokens_accounting_is_their_own():
    """`Accounting.per_token_between`: the summed figures over the tokens between two totals, not the engine's lifetime
    average (session 29's VRAM row: 3.43 ms a token of booking over 120 tokens, 72 of them the warm-up and the tier's
    fill)."""
    from gpu_worker.streaming import Accounting
    a = Accounting(tokens=72, ms_bookkeeping_after_launch=400.0)
    before = a.totals()
    a.tokens, a.ms_bookkeeping_after_launch, a.bytes_over_pcie = 120, 412.0, 48e6
    w = Accounting.per_token_between(before, a.totals())
    assert w["tokens"] == 48 and w["ms_bookkeeping_after_launch_per_token"] == 0.25
    assert w["bytes_over_pcie_per_token"] == 1e6 and w["ms_experts_per_token"] == 0.0
    assert set(w) == set(a.per_token()) - {"vram_hit_rate", "hit_rate", "ups_dma_gave_up", "staged_up_use_rate"}
    assert 412.0 / 120 > 3.4 > w["ms_bookkeeping_after_launch_per_token"]     # the lifetime average, the twin
    assert Accounting.per_token_between(before, before)["ms_bookkeeping_after_launch_per_token"] == 0.0


def test_each_arm_gets_the_io_account_of_its_own_windows(monkeypatch):
    """io (the IO trace's summary) is called once per arm with the windows of that arm's runs only; each arm keeps
    its own count of reads ahead held."""
    monkeypatch.delenv("MOESTREAM_AB_PROBE", raising=False)

    def fake_run(eng, prompts, n_tokens, device):
        v = os.environ.get("MOESTREAM_AB_PROBE") or "0"
        return dict(ms_per_token_all=[1.0], windows_ns=[(int(v) * 100 + prompts[0], int(v) * 100 + prompts[0] + 1)],
                    cache={"prefetch_held": 7 * int(v)})
    monkeypatch.setattr(e2e_stream, "decode_run", fake_run)
    ab = e2e_stream.ab_in_engine(None, "MOESTREAM_AB_PROBE=1", 2, lambda k: [k], 4, "cpu", shared=False,
                                 io=lambda w: sorted(w))
    # two arms, each its own prompts (round k, arm i: k * 2 + i): a decodes 0 and 2, b 1 and 3 (its windows at +100)
    assert ab["a_io"] == [(0, 1), (2, 3)] and ab["b_io"] == [(101, 102), (103, 104)]
    assert ab["a_held"] == [0, 0] and ab["b_held"] == [7, 7]          # each arm's reads ahead held, by round


def test_an_arm_sets_several_variables_together(monkeypatch):
    """K1=V1,K2=V2 in one arm sets both for that arm only (session 33: the hold with the whole guess); the arm that
    names only K1 leaves K2 as it was (the twin: an arm leaking its second variable into the next would show K2)."""
    monkeypatch.delenv("MOESTREAM_AB_PROBE", raising=False)
    monkeypatch.setenv("MOESTREAM_AB_OTHER", "12")
    seen = []
    monkeypatch.setattr(e2e_stream, "decode_run",
                        lambda *a: seen.append((os.environ.get("MOESTREAM_AB_PROBE"),
                                                os.environ.get("MOESTREAM_AB_OTHER"))) or dict(ms_per_token_all=[1.0]))
    e2e_stream.ab_in_engine(None, "MOESTREAM_AB_PROBE=1;MOESTREAM_AB_PROBE=1,MOESTREAM_AB_OTHER=0", 2, lambda k: [k],
                            4, "cpu")
    # round 0: a b c; round 1: b c a
    assert seen == [(None, "12"), ("1", "12"), ("1", "0"), ("1", "12"), ("1", "0"), (None, "12")]
    assert "MOESTREAM_AB_PROBE" not in os.environ and os.environ["MOESTREAM_AB_OTHER"] == "12"
    with pytest.raises(SystemExit, match="apart by ','"):
        e2e_stream.ab_in_engine(None, "MOESTREAM_AB_PROBE=1,MOESTREAM_AB_OTHER", 1, lambda k: [k], 4, "cpu")


def test_each_arm_gets_the_routes_host_time_of_its_own_rounds(monkeypatch):
    """Each arm's route bookkeeping a token (and the staging's take in it), from the engine's accounting over that
    arm's decode alone: the b rounds' take is the smaller here, and a's figures are not b's."""
    from gpu_worker.streaming import Accounting
    monkeypatch.delenv("MOESTREAM_AB_PROBE", raising=False)

    class Eng:
        accounting = Accounting()

    def fake_run(eng, prompts, n_tokens, device):
        on = os.environ.get("MOESTREAM_AB_PROBE") == "1"
        a = eng.accounting
        a.tokens += 10
        a.ms_bookkeeping += 2.0 if on else 3.0
        a.ms_bookkeeping_take += 0.5 if on else 1.0
        return dict(ms_per_token_all=[1.0])
    monkeypatch.setattr(e2e_stream, "decode_run", fake_run)
    ab = e2e_stream.ab_in_engine(Eng(), "MOESTREAM_AB_PROBE=1", 2, lambda k: [k], 10, "cpu")
    assert ab["a_bookkeeping_ms"] == [(0.3, 0.1)] * 2 and ab["b_bookkeeping_ms"] == [(0.2, 0.05)] * 2
