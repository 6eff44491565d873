"""`VramTier.lookup_slots`, the decode route's lookup, whose uses are added to the counts after the launch
(`score_uses`, or whatever reads or changes the counts next), decides exactly as `lookup`, which counts at once:
the same experts found, admitted and evicted, the same decayed counts to the bit, on a skewed trace through a tier
smaller than its working set, with the counts rescaled every ~25 tokens. Twins that must fail: the deferred uses
dropped, and the deferred uses added after the next token's tick (at the wrong weight)."""
import pytest
import torch

from gpu_worker.vram_tier import VramTier
from tests.gpu_worker.test_vram_tier_admission import zipf


class TickFirst(VramTier):
    """The twin: the pending uses added only after the next token's tick."""

    def lookup_slots(self, j, experts):
        if j == 0:
            self._tick()
        self.score_uses()
        row = self._rows.get(j)
        if not row:
            return None
        slots = [row.get(e, -1) for e in experts]
        n = len(slots) - slots.count(-1)
        if not n:
            return None
        self.hits += n
        self._unscored = (j, experts, slots)
        return slots

    def _tick(self):
        pending, self._unscored = self._unscored, None        # the tick without adding them first
        super()._tick()
        self._unscored = pending


def run(vt, tokens, aligned: bool):
    """One lookup per MoE layer, then want / admit for the rest, as gpu_worker/streaming.py drives the tier. aligned:
    `lookup_slots`, its uses added by an explicit `score_uses` at two layers in three (as `decode_launched` does),
    left to the next call at the third (the route's miss branch). Returns the log of every step and the counts."""
    src = torch.zeros(vt.block_bytes, dtype=torch.uint8)
    log = []
    for t, tok in enumerate(tokens):
        for j, ex in enumerate(tok):
            ex = list(ex)
            if aligned:
                vs = vt.lookup_slots(j, ex)
                found = {e: v for e, v in zip(ex, vs) if v >= 0} if vs else {}
                if (t + j) % 3:
                    vt.score_uses()
            else:
                found = vt.lookup(j, ex)
            for e in ex:
                if e not in found and vt.want(j, e):
                    vt.admit(j, e, src)
            log.append((t, j, found, dict(vt.slot_of), vt.admissions, vt.evictions, vt.hits))
    return log, vt.score


def tier(cls=VramTier):
    return cls(24, 8, 8, "cpu", admit_after=2, half_life_tokens=0.05)    # x 2^20 a token: rescaled every ~25


# the last layer always the same three experts: once resident, all found, so a token's last uses may wait for the next
# token's first lookup (the tick)
TOKENS = [tok[:2] + [(1, 2, 3)] for tok in zipf(tokens=120, layers=3, n_experts=40, top_k=6, seed=3)]


def differences(aligned_tier) -> list[str]:
    ref_log, ref_score = run(tier(), TOKENS, aligned=False)
    log, score = run(aligned_tier, TOKENS, aligned=True)
    bad = [f"token {a[0]} layer {a[1]}: {a[2:]} != {b[2:]}" for a, b in zip(ref_log, log) if a != b][:3]
    if score != ref_score:
        bad.append(f"counts differ at {sorted(k for k in ref_score if score.get(k) != ref_score[k])[:5]}")
    return bad


def test_the_trace_evicts_and_rescales():
    log, _ = run(tier(), TOKENS, aligned=False)
    assert log[-1][5] > 20 and log[-1][6] > 100          # evictions, hits


def test_deferred_uses_decide_as_lookup():
    assert differences(tier()) == []


@pytest.mark.parametrize("broken", ["uses dropped", "added after the tick"])
def test_twin_is_caught(broken, monkeypatch):
    vt = tier(TickFirst if broken == "added after the tick" else VramTier)
    if broken == "uses dropped":
        monkeypatch.setattr(vt, "score_uses", lambda: setattr(vt, "_unscored", None))
    assert differences(vt) != []
