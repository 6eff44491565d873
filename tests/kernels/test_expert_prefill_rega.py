"""The grouped expert prefill with x's columns permuted so that the decoded code words are the tensor cores' register
operand (kernels/expert_prefill_rega.py, the engine's Gluon kernels in kernels/expert_prefill_rega_gluon.py, the
variants measured on the way in bench/kernels/expert_prefill_rega_gluon.py): the permutation, the Triton twin against
the PyTorch reference of the layer (interpreter on a CPU), the Gluon kernels against both (GPU only: Gluon has no
interpreter), the Gluon kernels compiled for sm_90 / sm_120 on the CPU, and the engine's route to them
(`expert_prefill_grouped`'s "rega" path: when it is chosen, the scales by expert, h reused, the reads it counts)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import torch

import kernels.expert_prefill as ep
from kernels import expert_prefill_rega as R
from kernels.expert_prefill import expert_prefill_grouped_torch
from kernels.testing import assert_close, rel_err
from test_expert_prefill import L, _layer, _routed

# the twin's tiles: small under the interpreter; on a GPU (where it is only a reference) the sweep's 128 x 128, which
# compiled right in session 37's call 1 (its 16 x 32 tiles did not: rel err 3.5 on the H100, bench/NOTES.md)
CFG = (dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3) if torch.cuda.is_available()
       else dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1))
GLUON = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
# the mma.sync version (MMA 2) runs on sm_80 and later; the wgmma ones on sm_90 only
MMA_V2 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


def test_permutation_places_each_columns_nibble_pair():
    """Column 64 h + 8 p + 4 e + q of a block lands at 16 (4 h + q) + 2 p + e; K = 200 pads to 256 with zeros (in
    the last block's permuted places) and comes back; the old layout (column 8 i + q at 16 q + i) is a different
    permutation (the twin that must fail)."""
    cols = torch.arange(200.0)[None, :]
    xp = R.permute_cols(cols)
    assert xp.shape == (1, 256) and torch.equal(R.unpermute_cols(xp, 200), cols)
    for c in (0, 5, 77, 127, 128 + 8 * 3 + 4 + 2):
        r = c % 128
        h, p, e, q = r // 64, (r % 64) // 8, (r % 8) // 4, r % 4
        assert xp[0, c - r + 16 * (4 * h + q) + 2 * p + e] == c
    assert torch.equal(xp[0].sort().values, torch.cat([torch.zeros(56), cols[0]]).sort().values)  # 56 pad zeros
    old = torch.arange(128.0).view(16, 8).t().reshape(-1)
    assert not torch.equal(old, xp[0, :128])


def test_permute_x_kernel_equals_the_torch_layout(device):
    """One pass (scale, fp16, permute) equals permute_cols of x · 2^-8 for bf16 rows of odd length, both ways of K."""
    for M, K in ((37, 200), (5, 256)):
        x = torch.randn(M, K, device=device).bfloat16() * 30
        want = R.permute_cols((x.float() * R.X_PRESCALE).half())
        got = R.permute_x(x)
        assert got.dtype == torch.float16 and torch.equal(got, want)
    assert not torch.equal(R.permute_x(x), R.permute_cols((x.flip(1).float() * R.X_PRESCALE).half()))


def test_permute_x_gathers_the_rows_it_is_given(device):
    """rows given: the output's row r is permute_x(x)[rows[r]] (the engine's launch gathers its tokens' rows of the
    span's x in the same pass), rows repeated and out of order, more or fewer than x has; must fail: rows shifted."""
    x = torch.randn(23, 200, device=device).bfloat16() * 30
    for n in (41, 7):
        rows = torch.randint(0, 23, (n,), device=device)
        got = R.permute_x(x, rows=rows)
        assert got.shape == (n, 256) and torch.equal(got, R.permute_x(x)[rows])
    assert not torch.equal(R.permute_x(x, rows=(rows + 1) % 23), R.permute_x(x)[rows])
    assert R.permute_x(x, rows=rows[:0]).shape == (0, 256)


@pytest.mark.parametrize("T,k,fetch", [(29, 3, "0"), (37, 2, "0"), (31, 3, "1")])
def test_rega_twin_matches_the_layer(T, k, fetch, device, monkeypatch):
    """The Triton twin (words per half block, nibble pairs joined) equals the reference layer on L 48 / I 80 (one
    partial 128-block each way), an unrouted expert and partial row tiles; each expert's neighbour's block must
    fail. fetch "1": the launch's table copied by its permute_x launch (MOESTREAM_REGA_TABLE_IN_PERMUTE)."""
    monkeypatch.setenv(R.TABLE_IN_PERMUTE_ENV, fetch)
    E = 5
    geom, blocks, ug, dg, _, _ = _layer(E, device)
    _, _, tok, w, segments = _routed(T, k, E, device)
    xs = torch.randn(T, L, device=device).bfloat16()[tok]
    ref = expert_prefill_grouped_torch(xs, segments, blocks, geom, ug, dg, w, tok, torch.zeros(T, L, device=device))
    addrs = [b.data_ptr() for b in blocks]
    got = R.rega(xs, segments, addrs, geom, ug, dg, w, tok, torch.zeros(T, L, device=device), config=CFG)
    assert_close(got, ref, 1e-3, "rega twin vs layer")
    rolled = [blocks[(i + 1) % E].data_ptr() for i in range(E)]
    bad = R.rega(xs, segments, rolled, geom, ug, dg, w, tok, torch.zeros(T, L, device=device), config=CFG)
    assert rel_err(bad, ref) > 0.1


def test_rega_twin_across_blocks(device):
    """K past one 128-block both ways (L 144, I 272: a full block and a partial one), against the reference."""
    from kernels.expert_block import ExpertGeometry, pack_expert_block
    from kernels.nvfp4 import encode_nvfp4
    Lw, Iw, E, T = 144, 272, 3, 21
    geom = ExpertGeometry(Lw, Iw, "nvfp4")
    blocks, ug, dg = [], [], []
    for _ in range(E):
        uq, us, u = encode_nvfp4(torch.randn(Iw, Lw) * torch.rand(Iw, 1))
        dq, ds, d = encode_nvfp4(torch.randn(Lw, Iw) * torch.rand(Lw, 1))
        blocks.append(pack_expert_block(geom, uq, us, dq, ds).to(device))
        ug.append(float(u))
        dg.append(float(d))
    ug, dg = torch.tensor(ug, device=device), torch.tensor(dg, device=device)
    tok = torch.arange(T, device=device).repeat_interleave(2)
    w = torch.rand(2 * T, device=device) + 0.1
    segments = [(0, 16), (16, 26)]
    xs = torch.randn(T, Lw, device=device).bfloat16()[tok][:42]
    ref = expert_prefill_grouped_torch(xs, segments, blocks[:2], geom, ug[:2], dg[:2], w, tok,
                                       torch.zeros(T, Lw, device=device))
    got = R.rega(xs, segments, [b.data_ptr() for b in blocks[:2]], geom, ug[:2], dg[:2], w, tok,
                 torch.zeros(T, Lw, device=device), config=CFG)
    assert_close(got, ref, 1e-3, "rega twin, two blocks")
    swapped = [blocks[1].data_ptr(), blocks[0].data_ptr()]
    bad = R.rega(xs, segments, swapped, geom, ug[:2], dg[:2], w, tok, torch.zeros(T, Lw, device=device), config=CFG)
    assert rel_err(bad, ref) > 0.1


def _gluon_case(cfg):
    ok, why = (MMA_V2, "mma.sync needs sm_80 or later") if cfg.get("MMA") == 2 else (GLUON, "wgmma is sm_90 only")
    return pytest.param(cfg, marks=pytest.mark.skipif(not ok, reason=f"Gluon has no interpreter; {why}"))


@pytest.mark.parametrize("cfg", [_gluon_case(c) for c in (
    dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, DEPTH=3, num_warps=8),
    dict(BLOCK_M=128, BLOCK_N=64, STAGES=3, DEPTH=4, num_warps=4),
    dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, DEPTH=5, num_warps=8),
    dict(BLOCK_M=64, BLOCK_N=128, STAGES=4, DEPTH=6, num_warps=8),
    dict(BLOCK_M=64, BLOCK_N=64, STAGES=2, DEPTH=1, num_warps=4),
    dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, DEPTH=7, num_warps=8),
    dict(BLOCK_M=64, BLOCK_N=64, STAGES=2, DEPTH=7, FENCE=0, num_warps=4),
    dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, DEPTH=6, STORE=0, num_warps=8),
    dict(BLOCK_M=256, BLOCK_N=128, STAGES=2, DEPTH=1, num_warps=8),
    dict(BLOCK_M=256, BLOCK_N=128, STAGES=2, DEPTH=5, TMA=True, num_warps=8),
    dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, DEPTH=5, TMA=True, PERSIST=5, num_warps=8),
    dict(BLOCK_M=64, BLOCK_N=64, STAGES=2, DEPTH=5, TMA=True, PERSIST=3, num_warps=4),
    dict(BLOCK_M=256, BLOCK_N=128, STAGES=2, DEPTH=5, TMA=True, PERSIST=True, num_warps=8),
    dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, DEPTH=5, TMA=True, num_warps=8),
    dict(BLOCK_M=64, BLOCK_N=64, STAGES=2, DEPTH=5, TMA=True, num_warps=4),
    dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, MMA=2, WARPS_N=2, num_warps=8),
    dict(BLOCK_M=64, BLOCK_N=64, STAGES=2, MMA=2, WARPS_N=1, num_warps=4))])
def test_rega_gluon_matches_the_twin_and_the_layer(cfg):
    """The Gluon kernels on the GPU: the odd layer (partial blocks, partial tiles) and Super's shape (32 rows an
    expert, 3 experts) against the reference; the rolled blocks must fail."""
    from bench.kernels.expert_prefill_rega_gluon import rega_gluon
    from kernels.expert_block import SUPER, pack_expert_block
    from kernels.nvfp4 import encode_nvfp4
    dev = "cuda"
    for geom_name in ("odd", "super"):
        if geom_name == "odd":
            E, T, k = 5, 37, 2
            geom, blocks, ug, dg, _, _ = _layer(E, dev)
            _, _, tok, w, segments = _routed(T, k, E, dev)
            Lx = L
        else:
            geom, E, T, Lx = SUPER, 3, 96, SUPER.L
            blocks, ugl, dgl = [], [], []
            for _ in range(E):
                uq, us, u = encode_nvfp4(torch.randn(geom.I, geom.L))
                dq, ds, d = encode_nvfp4(torch.randn(geom.L, geom.I))
                blocks.append(pack_expert_block(geom, uq, us, dq, ds).to(dev))
                ugl.append(float(u))
                dgl.append(float(d))
            ug, dg = torch.tensor(ugl, device=dev), torch.tensor(dgl, device=dev)
            tok = torch.arange(T, device=dev)
            w = torch.rand(T, device=dev) + 0.1
            segments = [(0, 32), (32, 41), (73, 23)]
        xs = torch.randn(T, Lx, device=dev).bfloat16()[tok]
        ref = expert_prefill_grouped_torch(xs, segments, blocks, geom, ug, dg, w, tok, torch.zeros(T, Lx, device=dev))
        got = rega_gluon(xs, segments, [b.data_ptr() for b in blocks], geom, ug, dg, w, tok,
                         torch.zeros(T, Lx, device=dev), config=cfg)
        assert_close(got, ref, 1e-3, f"rega gluon vs layer ({geom_name})")
        rolled = [blocks[(i + 1) % E].data_ptr() for i in range(E)]
        bad = rega_gluon(xs, segments, rolled, geom, ug, dg, w, tok, torch.zeros(T, Lx, device=dev), config=cfg)
        assert rel_err(bad, ref) > 0.1


def _cuda_backend():
    from tools.gpu_compile import has_cuda_backend
    return has_cuda_backend()


# the Gluon kernels' configs as the sweep and the GPU test run them, and the user's card's arch for mma.sync
_COMPILED = [(dict(DEPTH=1), 90), (dict(DEPTH=6), 90), (dict(DEPTH=7), 90), (dict(DEPTH=5, TMA=True), 90),
             (dict(DEPTH=5, TMA=True, PERSIST=True), 90),
             (dict(BLOCK_N=64, DEPTH=5, TMA=True, num_warps=4), 90), (dict(MMA=2, WARPS_N=2), 90),
             (dict(MMA=2, WARPS_N=1), 90), (dict(MMA=2, WARPS_N=2), 120)]
# the twin that must fail: 256-token tiles hold a 64 x 256 fp32 accumulator a warpgroup (128 registers a thread)
# beside the operands and x's addresses; DEPTH 7 keeps two blocks' operands as well, and spills (DEPTH 1 fits since
# session 40's stores)
_SPILLS = (dict(BLOCK_M=256, STAGES=2, DEPTH=7), 90)
# the engine's kernels (kernels/expert_prefill_rega_gluon.TMA_CONFIG, session 40's "d5tw"): the 256-row down ran with
# a 16-byte spill stack under the device's Triton 3.6 when it was measured (48 bytes under 3.9); more would be news
_ENGINE = (dict(DEPTH=5, TMA=True, BLOCK_M=256, STAGES=2), 90)
_ENGINE_DOWN_SPILL = 64


@pytest.fixture(scope="module")
def compiled():
    """Every case's up and down compiled in one child process without the interpreter (the suite runs under it)."""
    cases = [(part, cfg, arch) for cfg, arch in _COMPILED + [_SPILLS, _ENGINE] for part in ("up", "down")]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys; from bench.kernels.expert_prefill_rega_gluon import compile_report; "
            "print(json.dumps(compile_report(json.loads(sys.argv[1]))))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], env=env, capture_output=True, text=True,
                         timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _cuda_backend(), reason="needs Triton's NVIDIA backend (ptxas) to compile")
@pytest.mark.parametrize("cfg,arch", _COMPILED)
def test_gluon_kernels_compile_without_spills(compiled, cfg, arch):
    """Gluon has no interpreter, so this is the CPU's check of the kernels: each config's up and down compile with the
    installed Triton (CI's) for sm_90 (sm_120: the RTX 5060's build of the mma.sync version), in registers (no spill
    stack) and within a CTA's shared memory. Gluon's API moved between 3.6 and 3.9; this catches the next move."""
    rows = [r for r in compiled if r["config"] == cfg and r["arch"] == arch]
    assert [r["part"] for r in rows] == ["up", "down"]
    for r in rows:
        assert r["regs"] <= 255 and r["spill"] == 0, r
        assert r["shared"] <= 227 * 1024, r
        assert r["hazards"] == [], r           # no write to a register an in-flight wgmma still reads


# A loop of two HGMMA groups as ptxas writes them: the first group's A operand (R100..R103) is rewritten while the
# DEPBAR leaves one group in flight, and only the safe twin waits for every group first.
_LOOP = """
        /*0100*/                   WARPGROUP.ARRIVE ;
        /*0110*/                   HGMMA.64x128x16.F32 R24, R100, gdesc[UR16], R24, gsb0 ;
        /*0120*/                   HGMMA.64x128x16.F32 R24, R104, gdesc[UR16], R24, gsb0 ;
        /*0130*/                   WARPGROUP.DEPBAR.LE gsb0, {k} ;
        /*0140*/                   IMAD.MOV.U32 R101, RZ, RZ, R199 ;
        /*0148*/                   HGMMA.64x128x16.F32 R24, gdesc[UR4], R24 ;
        /*0150*/                   STG.E [R2.64], R104 ;
        /*0160*/              @P4  BRA 0x100 ;
"""


def test_the_operand_hazard_check_sees_a_register_rewritten_in_flight():
    """The check the compile test applies, on SASS whose answer is known: rewriting R101 with one group in flight
    (the second, R104..R107) is safe; with both in flight it is the hazard (session 40's DEPTH 7 had 46 of them). An
    HGMMA whose A is in shared memory (a descriptor) reads no register operand."""
    from bench.kernels.sass_probe import wgmma_operand_hazards
    assert wgmma_operand_hazards(_LOOP.format(k="0x1")) == []
    assert wgmma_operand_hazards(_LOOP.format(k="0x2")) == ["0x140 IMAD.MOV.U32 R101, RZ, RZ, R199"]


@pytest.mark.skipif(not _cuda_backend(), reason="needs Triton's NVIDIA backend (ptxas) to compile")
def test_the_engines_kernels_compile_as_measured(compiled):
    """The engine's config is one of the variants (its name and numbers in the module's header): its up in registers,
    its down within the small spill it was measured with, no operand hazard, the shared memory a CTA has."""
    from kernels.expert_prefill_rega_gluon import TMA_CONFIG
    assert {k: TMA_CONFIG[k] for k in ("BLOCK_M", "STAGES")} == {k: _ENGINE[0][k] for k in ("BLOCK_M", "STAGES")}
    rows = {r["part"]: r for r in compiled if r["config"] == _ENGINE[0]}
    assert rows["up"]["spill"] == 0 and rows["down"]["spill"] <= _ENGINE_DOWN_SPILL, rows
    for r in rows.values():
        assert r["regs"] <= 255 and r["shared"] <= 227 * 1024 and r["hazards"] == [], r


@pytest.mark.skipif(not _cuda_backend(), reason="needs Triton's NVIDIA backend (ptxas) to compile")
def test_the_spill_check_catches_a_tile_that_does_not_fit(compiled):
    rows = [r for r in compiled if r["config"] == _SPILLS[0]]
    assert len(rows) == 2 and all(r["spill"] > 0 for r in rows), rows


def test_persist_refuses_the_old_stores():
    """PERSIST's kernels have only the coalesced epilogue: a config asking for STORE 0 with it is refused by name,
    before any launch, rather than measured under a name it does not run."""
    from bench.kernels.expert_prefill_rega_gluon import rega_gluon
    from kernels.expert_block import SUPER
    z = torch.zeros(1)
    prepared = (z, 1, 0, 1, torch.zeros(1, SUPER.L), torch.zeros(1, SUPER.I))
    with pytest.raises(ValueError, match="STORE 1"):
        rega_gluon(None, [(0, 1)], [0], SUPER, z, z, z, z, z, prepared=prepared,
                   config=dict(TMA=True, DEPTH=5, PERSIST=True, STORE=0))


# ---- the engine's route: expert_prefill_grouped's "rega" path

def _scaled_layer(E, device):
    """_layer's experts with global scales 1x .. Ex apart (a scale read for the wrong expert is caught)."""
    geom, blocks, ug, dg, _, _ = _layer(E, device)
    f = torch.arange(1.0, E + 1, device=device)
    return geom, blocks, ug * f, dg * f.flip(0)


def test_the_rega_path_reads_the_layers_scales_by_expert(device):
    """The engine's call: a launch over some of a layer's experts in its own order, their global scales given as the
    layer's whole row with gs_index (gathered once), h handed in; equal to the reference. Must fail: the scales
    indexed in launch order (gs_index left out)."""
    E, T = 6, 33
    geom, blocks, ug, dg = _scaled_layer(E, device)
    order = [4, 1, 3]
    segments = [(0, 11), (11, 0), (11, 22)]
    tok = torch.randint(0, T, (33,), device=device)
    w = torch.rand(33, device=device) + 0.1
    xs = torch.randn(33, L, device=device).bfloat16()
    ref = expert_prefill_grouped_torch(xs, segments, [blocks[e] for e in order], geom, ug[order], dg[order], w, tok,
                                       torch.zeros(T, L, device=device))
    h = torch.empty(33 * geom.I, dtype=torch.float16, device=device)
    addrs = [blocks[e].data_ptr() for e in order]
    got = ep.expert_prefill_grouped(xs, segments, addrs, geom, ug, dg, w, tok, torch.zeros(T, L, device=device),
                                    config=CFG, h=h, path="rega", gs_index=order)
    assert_close(got, ref, 1e-3, "rega path with the layer's scales")
    bad = ep.expert_prefill_grouped(xs, segments, addrs, geom, ug[:3], dg[:3], w, tok,
                                    torch.zeros(T, L, device=device), config=CFG, h=h, path="rega")
    assert rel_err(bad, ref) > 0.1


@pytest.mark.parametrize("path", ["rega", "fused"])
def test_a_launch_gathers_xs_rows_by_its_tokens(path, device):
    """x_index: the launch is given the span's x and its rows' tokens (the engine's rega launches: no gather of
    their own); rega gathers as it permutes, the other paths gather first: equal to the reference on the gathered
    rows. Must fail: the tokens rolled by one row."""
    E, T = 6, 19
    geom, blocks, ug, dg = _scaled_layer(E, device)
    order = [2, 5]
    segments = [(0, 13), (13, 20)]
    tok = torch.randint(0, T, (33,), device=device)
    w = torch.rand(33, device=device) + 0.1
    x = torch.randn(T, L, device=device).bfloat16()
    ref = expert_prefill_grouped_torch(x[tok], segments, [blocks[e] for e in order], geom, ug[order], dg[order], w,
                                       tok, torch.zeros(T, L, device=device))
    addrs = [blocks[e].data_ptr() for e in order]

    def run(index):
        return ep.expert_prefill_grouped(x, segments, addrs, geom, ug, dg, w, tok, torch.zeros(T, L, device=device),
                                         config=CFG, path=path, gs_index=order, x_index=index)
    assert_close(run(tok), ref, 1e-3, f"{path} with x_index")
    assert rel_err(run(tok.roll(1)), ref) > 0.1


def test_prepare_reuses_h_where_its_width_is_i(device):
    """I a multiple of 128: the up's output is a view of the caller's buffer (no allocation a launch); I = 80 pads to
    128 and needs zeros past I, so it gets its own (as does a buffer too small)."""
    from kernels.expert_block import ExpertGeometry
    x = torch.randn(20, 48, device=device).bfloat16()
    buf = torch.empty(20 * 128, dtype=torch.float16, device=device)
    got = R.prepare(x, [(0, 20)], [0], ExpertGeometry(48, 128, "nvfp4"), 16, h=buf)
    assert got[5].shape == (20, 128) and got[5].data_ptr() == buf.data_ptr()
    odd = R.prepare(x, [(0, 20)], [0], ExpertGeometry(48, 80, "nvfp4"), 16, h=buf)
    assert odd[5].shape == (20, 128) and odd[5].data_ptr() != buf.data_ptr() and not odd[5][:, 80:].any()
    small = R.prepare(x, [(0, 20)], [0], ExpertGeometry(48, 128, "nvfp4"), 16, h=buf[:100])
    assert small[5].data_ptr() != buf.data_ptr()


def test_the_auto_path_takes_rega_by_rows_an_expert(monkeypatch):
    """Where the Gluon kernels can run (faked here: a CPU has no sm_90), the auto path takes rega while every routed
    expert has at most one tile of rows (weights read zero-copy: one read each), or two with resident weights; above,
    the dequantized path as before. The blocks it reads: one per 256-row tile."""
    from kernels.expert_block import SUPER
    xb = torch.zeros(1, SUPER.L, dtype=torch.bfloat16)
    assert not ep.rega_able(xb, SUPER)                               # a CPU: never
    monkeypatch.setattr(ep, "rega_able", lambda x, geom: True)
    tile, most = ep.REGA_TILE_ROWS, ep.REGA_RESIDENT_MAX_ROWS
    assert ep.grouped_path(xb, [(0, 3), (3, 0), (3, tile)], SUPER) == "rega"
    assert ep.grouped_path(xb, [(0, 40), (40, tile + 1)], SUPER) == "dequant"
    assert ep.grouped_path(xb, [(0, 40), (40, tile + 1)], SUPER, resident=True) == "rega"
    assert ep.grouped_path(xb, [(0, 40), (40, most + 1)], SUPER, resident=True) == "dequant"
    assert ep.grouped_path(xb, [(0, 3), (3, 5)], SUPER, "fused") == "fused"     # a caller's path stands
    # the engine's question a layer, with its largest count
    assert ep.rega_takes(xb, tile, SUPER) and not ep.rega_takes(xb, tile + 1, SUPER)
    assert ep.rega_takes(xb, most, SUPER, resident=True) and not ep.rega_takes(xb, most + 1, SUPER, resident=True)
    assert not ep.rega_takes(xb, 0, SUPER)
    assert ep.block_reads([(0, 40), (40, 0), (40, tile + 1)], SUPER, xb, path="rega") == 1 + 2
    assert ep.block_reads([(0, 40), (40, tile + 1)], SUPER, xb, resident=True) == 1 + 2
    assert ep.block_reads([(0, 40), (40, tile + 1)], SUPER, xb) == 2                # dequantized: once each


def test_the_rega_switch(monkeypatch):
    """MOESTREAM_PREFILL_REGA=0 turns the path off for the auto choice (a forced "rega" still runs: the twin); any
    other value than 0 or 1 is refused by name."""
    from kernels.expert_block import SUPER
    xb = torch.zeros(1, SUPER.L, dtype=torch.bfloat16)
    monkeypatch.setenv("MOESTREAM_PREFILL_REGA", "2")
    with pytest.raises(ValueError, match="MOESTREAM_PREFILL_REGA"):
        ep.rega_able(xb, SUPER)
    monkeypatch.setenv("MOESTREAM_PREFILL_REGA", "0")
    monkeypatch.setattr(ep, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert not ep.rega_able(xb, SUPER)
    monkeypatch.setenv("MOESTREAM_PREFILL_REGA", "1")
    assert ep.rega_able(xb, SUPER)


@pytest.mark.skipif(not GLUON, reason="Gluon has no interpreter; wgmma is sm_90 only")
@pytest.mark.parametrize("n", [16, 8])
def test_the_engines_route_runs_the_gluon_kernels(n):
    """On sm_90 the engine's auto path takes the Gluon kernels for Super's shape at up to a tile of rows an expert
    (two with resident weights), the layer's scales by expert, h handed in, a split store's downs regrouped, x's rows
    given or gathered by the launch's tokens; equal to the reference. The engine's long rega launches
    (`gpu_worker.prefill_knobs.rega_long`: path "rega" asked for, resident weights, experts of several tiles, the auto
    path's choice dequantized) too. Must fail: the blocks rolled."""
    from kernels.expert_block import SUPER, ExpertGeometry, pack_expert_block
    from kernels.nvfp4 import encode_nvfp4
    dev, E = "cuda", 5
    geom = ExpertGeometry(SUPER.L, SUPER.I, "nvfp4", down_group_neurons=n)
    blocks, ugl, dgl = [], [], []
    for e in range(E):
        uq, us, u = encode_nvfp4(torch.randn(geom.I, geom.L))
        dq, ds, d = encode_nvfp4(torch.randn(geom.L, geom.I))
        blocks.append(pack_expert_block(geom, uq, us, dq, ds).to(dev))
        ugl.append(float(u) * (e + 1))
        dgl.append(float(d))
    ug, dg = torch.tensor(ugl, device=dev), torch.tensor(dgl, device=dev)
    order = [3, 0, 4]
    for segments, resident, path in (([(0, 37), (37, 256), (293, 5)], False, "auto"),
                                     ([(0, 300), (300, 1), (301, 130)], True, "auto"),
                                     ([(0, 1100), (1100, 3), (1103, 701)], True, "rega")):
        M = sum(c for _, c in segments)
        tok = torch.randint(0, M, (M,), device=dev)
        w = torch.rand(M, device=dev) + 0.1
        xs = torch.randn(M, geom.L, device=dev).bfloat16()
        assert ep.grouped_path(xs, segments, geom, resident=resident) == ("rega" if path == "auto" else "dequant")
        ref = expert_prefill_grouped_torch(xs, segments, [blocks[e] for e in order], geom, ug[order], dg[order], w,
                                           tok, torch.zeros(M, geom.L, device=dev))
        h = torch.empty(M * geom.I, dtype=torch.float16, device=dev)
        got = ep.expert_prefill_grouped(xs, segments, [blocks[e].data_ptr() for e in order], geom, ug, dg, w, tok,
                                        torch.zeros(M, geom.L, device=dev), h=h, gs_index=order, resident=resident,
                                        path=path)
        assert_close(got, ref, 1e-3, f"the engine's rega route (n={n}, resident={resident})")
        # the engine's launch: the span's x and the rows' tokens, gathered as the rows are permuted
        ref_t = expert_prefill_grouped_torch(xs[tok], segments, [blocks[e] for e in order], geom, ug[order],
                                             dg[order], w, tok, torch.zeros(M, geom.L, device=dev))
        got_t = ep.expert_prefill_grouped(xs, segments, [blocks[e].data_ptr() for e in order], geom, ug, dg, w, tok,
                                          torch.zeros(M, geom.L, device=dev), h=h, gs_index=order,
                                          resident=resident, x_index=tok, path=path)
        assert_close(got_t, ref_t, 1e-3, f"the rega route gathering x (n={n}, resident={resident})")
        rolled = [blocks[order[(i + 1) % 3]].data_ptr() for i in range(3)]
        bad = ep.expert_prefill_grouped(xs, segments, rolled, geom, ug, dg, w, tok, torch.zeros(M, geom.L, device=dev),
                                        h=h, gs_index=order, resident=resident, path=path)
        assert rel_err(bad, ref) > 0.1
