"""bench.decode_timeline's split of a token: the bus's readers (expert kernels, host-to-device copies) against the
dense kernels."""
import pytest

from bench.decode_timeline import is_expert, mean_split, token_split


def k(name, ts, dur):
    return dict(kind="kernel", name=name, ts=ts, dur=dur)


def c(ts, dur, h2d=True):
    return dict(kind="copy", name="Memcpy HtoD" if h2d else "Memcpy DtoD", ts=ts, dur=dur, h2d=h2d)


def test_a_token_cut_by_what_ran():
    ev = [k("gemv_dense", 0, 30), c(10, 30), k("_expert_layer_kernel_0d1d", 50, 40), k("rms_norm", 95, 3),
          c(60, 10), c(0, 100, h2d=False)]          # a device-to-device copy is not the bus
    s = token_split(ev, 0, 100)
    assert s["wall"] == 100
    assert s["both"] == pytest.approx(20)            # the staging copy under the dense GEMV (10-30)
    assert s["bus"] == pytest.approx(10 + 40)        # 30-40 the copy alone, 50-90 the experts (the copy inside)
    assert s["dense"] == pytest.approx(10 + 3)       # 0-10, 95-98
    assert s["neither"] == pytest.approx(10 + 5 + 2)   # 40-50, 90-95, 98-100
    assert s["expert_kernels"] == 40 and s["copies"] == 40 and s["copies_beside_experts"] == 10
    assert s["bus_idle"] == pytest.approx(100 - 70)
    assert sum(s[x] for x in ("both", "bus", "dense", "neither")) == pytest.approx(s["wall"])


def test_only_the_window_counts_and_the_twin_kernel_is_dense():
    ev = [k("_expert_layer_kernel", 90, 40), k("_expert_layer", 0, 50)]     # a name short of the kernel's: dense
    s = token_split(ev, 0, 100)
    assert s["expert_kernels"] == 10 and s["dense"] == 50
    assert not is_expert("_expert_layer") and is_expert("_sparse_down_sub_kernel")


def test_mean_of_tokens():
    rows = [token_split([k("_vram_up_kernel", 0, 10)], 0, 20), token_split([k("_vram_up_kernel", 0, 30)], 0, 40)]
    assert mean_split(rows)["expert_kernels"] == 20 and mean_split([]) == {}
