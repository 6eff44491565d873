"""Co-activation order: permute each routed expert's neurons so that neurons that fire together share a down
group, and write the permuted checkpoint in the same hub layout.

    python -m tools.coactivation --model DIR --text-file F --out DIR2 [--requantize]
        [--order coactivation|frequency|identity|random] [--max-tokens 2048] [--seed 0]

The sparse down reads a 16-neuron group (or an N-neuron sub-group, `--down-group-neurons`) whenever any of
its neurons has a non-zero ReLU² output. Which neurons share a group is free: a permutation P of an expert's
intermediate dimension, applied to the rows of up and the columns of down together, leaves the expert's
output unchanged in real arithmetic (down·relu²(P·up·x) with down·Pᵀ). So, offline, the checkpoint runs on
calibration text on the CPU (the model's own forward, through an ExpertSource that records which neurons
fire), and each expert's neurons are grouped: greedily (a group starts from the most frequent free neuron and
takes, one at a time, the free neuron that adds the fewest calibration tokens to the group's union of firing
tokens) or by firing frequency, whichever reads fewer groups on the calibration tokens, then improved by
pairwise swaps between groups; each group is then ordered greedily into halves of 8, 4 and 2 for the
sub-groups.

Exactness by format: BF16 / FP16 / FP32 and per-tensor FP8 experts are permuted exactly (rows and columns
move, values and scales untouched). NVFP4 up is exact too (a row keeps its own scales). NVFP4 down is not:
its e4m3 scales cover 16 consecutive neurons of a row, so regrouping the neurons changes the groups and down
must be requantized (decode, permute, ModelOpt-exact encode with the same global scale). That is lossy and
opt-in: without `--requantize` an NVFP4 checkpoint is refused. The exact path for an NVFP4 store: order the BF16
master here, then quantize the ordered checkpoint (`python -m tools.instrument_hub --model ORDERED --out DIR`), as
tools.instrument_downbytes does in memory on the device for the main instrument. `bench.coactivation` measures the cost (KL,
perplexity) beside the down bytes it saves. The permutations and the calibration counts are written to
`coactivation.json` in the output directory.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from kernels.nvfp4 import decode_nvfp4, encode_nvfp4
from nemotron.moe import ExpertSource

ORDERS = ("coactivation", "frequency", "identity", "random")
SUB_GROUPS = (16, 8, 4, 2)          # the greedy's levels; 1-neuron sub-groups need no order
SUMMARY = "coactivation.json"


class RecordingExperts(ExpertSource):
    """The checkpoint's experts (plain torch, as CheckpointExperts) that also record, per (layer, expert), which
    neurons fire (ReLU² output ≠ 0) for every token routed to it."""
    wants_guess = False

    def __init__(self, inner):
        self.inner = inner
        self.fired: dict[tuple[int, int], list[torch.Tensor]] = {}

    def weights(self, layer, e):
        return self.inner.weights(layer, e)

    def apply(self, moe_index, layer, x, experts, weights, guess=None):
        from kernels.linear import linear
        from nemotron.moe import relu2
        acc = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e in torch.unique(experts).tolist():
            tok, slot = torch.where(experts == e)
            up, down = self.inner.weights(layer, e)
            a = relu2(linear(x[tok], up))
            self.fired.setdefault((layer, e), []).append((a != 0).cpu())
            acc.index_add_(0, tok, linear(a, down) * weights[tok, slot, None])
        return acc


def record_firing(model_dir, ids: list[int], chunk: int = 64) -> dict[tuple[int, int], torch.Tensor]:
    """(layer, expert) -> bool [tokens routed to it, I]: which neurons fired, over the calibration ids."""
    from nemotron.checkpoint import Checkpoint
    from nemotron.model import NemotronH
    from nemotron.moe import CheckpointExperts
    ckpt = Checkpoint(model_dir)
    src = RecordingExperts(CheckpointExperts(ckpt, "cpu"))
    model = NemotronH(ckpt, experts=src)
    state = model.new_state()
    with torch.no_grad():
        for s in range(0, len(ids), chunk):
            model.forward(ids[s:s + chunk], state)
    return {k: torch.cat(v) for k, v in src.fired.items()}


def _greedy_groups(fired: torch.Tensor, size: int) -> list[list[int]]:
    """Partition the columns of fired (float 0/1 [T, n]) into groups of `size` (the last may be short), each
    grown by the column that adds the fewest tokens to the group's union; the returned lists are in the
    order the columns joined, so a group's prefix is its most co-active part."""
    T, n = fired.shape
    freq = fired.sum(0)
    free = torch.ones(n, dtype=torch.bool)
    # Ties in added tokens go to the more frequent column: one fully inside the union is co-active, one
    # that never fired is only cheap here.
    tie = freq / (T + 1)
    groups = []
    while bool(free.any()):
        seed = int(torch.where(free, freq, torch.tensor(-1.0)).argmax())
        group, free[seed] = [seed], False
        union = fired[:, seed].clone()
        while len(group) < size and bool(free.any()):
            added = freq - union @ fired
            j = int(torch.where(free, added - tie, torch.tensor(float("inf"))).argmin())
            group.append(j)
            free[j] = False
            union = torch.maximum(union, fired[:, j])
        groups.append(group)
    return groups


def _unions(f: torch.Tensor, groups: list[list[int]]) -> int:
    return sum(int(f[:, g].amax(1).sum()) for g in groups)


def _refine_by_swaps(f: torch.Tensor, groups: list[list[int]], passes: int) -> list[list[int]]:
    """Swap one neuron between two groups wherever that lowers the summed unions (tokens × groups with a
    firing neuron), the best swap per pair of groups, until a pass finds none or `passes` are done."""
    for _ in range(passes):
        improved = False
        for ga in range(len(groups)):
            for gb in range(ga + 1, len(groups)):
                A, B = groups[ga], groups[gb]
                fa, fb = f[:, A], f[:, B]                                  # [T, a], [T, b]
                ca, cb = fa.sum(1)[:, None, None], fb.sum(1)[:, None, None]
                # A with A[i] out and B[j] in, and B the other way round: [T, a, b]
                new_a = (ca - fa[:, :, None] + fb[:, None, :]) > 0
                new_b = (cb - fb[:, None, :] + fa[:, :, None]) > 0
                delta = new_a.sum(0) + new_b.sum(0) - int((ca > 0).sum() + (cb > 0).sum())
                if int(delta.min()) < 0:
                    i, j = divmod(int(delta.argmin()), len(B))
                    A[i], B[j] = B[j], A[i]
                    improved = True
        if not improved:
            break
    return groups


def coactivation_order(fired: torch.Tensor, levels=SUB_GROUPS, refine_passes: int = 4) -> torch.Tensor:
    """bool [T, I] -> permutation int64 [I] (new position p holds old neuron perm[p]).

    Groups of levels[0]: the greedy's or the frequency sort's (whichever reads fewer groups on the
    calibration tokens: with dense firing the sort wins, with clustered firing the greedy), then improved
    by pairwise swaps; each group is split greedily into groups of levels[1], and so on."""
    def order(cols: list[int], lv) -> list[int]:
        if not lv or len(cols) <= lv[-1]:
            return cols
        sub = _greedy_groups(f[:, cols], lv[0])
        return [c for g in sub for c in order([cols[i] for i in g], lv[1:])]
    f = fired.float()
    n, size = fired.shape[1], levels[0]
    greedy = _greedy_groups(f, size)
    hot = torch.sort(f.sum(0), descending=True, stable=True).indices.tolist()
    by_freq = [hot[i:i + size] for i in range(0, n, size)]
    groups = min((greedy, by_freq), key=lambda g: _unions(f, g))
    groups = _refine_by_swaps(f, [list(g) for g in groups], refine_passes)
    return torch.tensor([c for g in groups for c in order(g, tuple(levels[1:]))], dtype=torch.long)


def make_order(kind: str, fired: torch.Tensor | None, n_inter: int, gen: torch.Generator) -> torch.Tensor:
    """The permutation of one expert; an expert never routed to on the calibration text keeps its order."""
    if kind not in ORDERS:
        raise ValueError(f"unknown order {kind!r} (one of {', '.join(ORDERS)})")
    if kind == "identity" or fired is None:
        return torch.arange(n_inter)
    if kind == "random":     # a control: what a blind regrouping (and its requantization) costs
        return torch.randperm(n_inter, generator=gen)
    if kind == "frequency":  # the simple baseline: hot neurons together, cold together
        return torch.sort(fired.float().sum(0), descending=True, stable=True).indices
    return coactivation_order(fired)


def groups_read(fired: torch.Tensor, perm: torch.Tensor, n: int) -> int:
    """Down (sub-)groups of n neurons with a firing neuron, summed over the tokens, under the order perm."""
    f = fired[:, perm]
    pad = -f.shape[1] % n
    if pad:
        f = torch.cat([f, torch.zeros(f.shape[0], pad, dtype=torch.bool)], 1)
    return int(f.view(f.shape[0], -1, n).any(-1).sum())


# ---------------------------------------------------------------- the permuted checkpoint

class NeedsRequantize(ValueError):
    pass


def _needs_requantize(down_module: str) -> str:
    return (f"{down_module}.weight is NVFP4: its e4m3 scales cover 16 consecutive neurons, so regrouping the "
            f"neurons changes them; pass --requantize to re-encode down (lossy; bench.coactivation measures "
            f"the cost), or order a BF16 checkpoint before quantizing it")


def permute_expert(tensors: dict[str, torch.Tensor], up: str, down: str, perm: torch.Tensor,
                   requantize: bool, permute_down: bool = True) -> int:
    """Permute one expert's tensors in `tensors` (stored names up / down are module prefixes) in place;
    returns how many down tensors were requantized (0 or 1). permute_down=False is the must-fail twin."""
    w = tensors[up + ".weight"]
    tensors[up + ".weight"] = w[perm].contiguous()           # rows: any format, a row keeps its scales
    s = tensors.get(up + ".weight_scale")
    if s is not None and s.dim() == 2:                       # NVFP4: [I, L/16] per-row block scales
        tensors[up + ".weight_scale"] = s[perm].contiguous()
    if not permute_down:
        return 0
    w = tensors[down + ".weight"]
    if w.dtype != torch.uint8:                               # dense or per-tensor FP8: columns move exactly
        tensors[down + ".weight"] = w[:, perm].contiguous()
        return 0
    if not requantize:
        raise NeedsRequantize(_needs_requantize(down))
    s = tensors[down + ".weight_scale"]
    g = tensors[down + ".weight_scale_2"]
    dense = decode_nvfp4(w, s.view(torch.float8_e4m3fn) if s.dtype == torch.uint8 else s, g)
    # The global scale is amax / (6·448): a permutation keeps the amax, so the same scale is passed on.
    nw, ns, _ = encode_nvfp4(dense[:, perm], g.reshape(()))
    tensors[down + ".weight"] = nw
    tensors[down + ".weight_scale"] = ns.view(torch.uint8) if s.dtype == torch.uint8 else ns
    return 1


def _expert_tensor_names(ckpt, layer: int, e: int) -> list[str]:
    return [n for p in ("up", "down") for suffix in (".weight", ".weight_scale", ".weight_scale_2", ".input_scale")
            if ckpt.has(n := ckpt.expert_module(layer, e, p) + suffix)]


def write_permuted(model_dir, out, perms: dict[tuple[int, int], torch.Tensor], requantize: bool = False,
                   permute_down: bool = True) -> int:
    """Copy the checkpoint at model_dir to out with every expert in perms permuted; shards keep their names
    and the index its map. Returns the number of requantized down tensors."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from nemotron.checkpoint import Checkpoint
    src, out = Path(model_dir), Path(out)
    if out.resolve() == src.resolve():
        raise ValueError(f"{out}: the output must be a new directory, not the input checkpoint")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out}: output directory exists and is not empty")
    ckpt = Checkpoint(src)
    if permute_down and not requantize:     # refuse before anything is written
        for (layer, e), perm in perms.items():
            m = ckpt.expert_module(layer, e, "down")
            if ckpt.info(m + ".weight")[0] == "U8" and not torch.equal(perm, torch.arange(perm.numel())):
                raise NeedsRequantize(_needs_requantize(m))
    # An expert's tensors may straddle two shards: each shard takes its own tensors of every expert it touches.
    experts_of: dict[Path, list[tuple[int, int]]] = {}
    for layer, e in perms:
        for name in _expert_tensor_names(ckpt, layer, e):
            lst = experts_of.setdefault(ckpt.shard_of(name), [])
            if not lst or lst[-1] != (layer, e):
                lst.append((layer, e))
    out.mkdir(parents=True, exist_ok=True)
    shards = {ckpt.shard_of(n) for n in ckpt.tensor_names()}
    requantized = 0
    for p in sorted(src.iterdir()):
        if p not in shards:
            (shutil.copytree if p.is_dir() else shutil.copy2)(p, out / p.name)
    for shard in sorted(shards):
        if shard not in experts_of:
            shutil.copy2(shard, out / shard.name)
            continue
        with safe_open(shard, framework="pt") as f:
            meta = f.metadata()
        tensors = load_file(shard)
        for layer, e in experts_of[shard]:
            names = _expert_tensor_names(ckpt, layer, e)
            mine = {ckpt.stored_name(n) for n in names if ckpt.shard_of(n) == shard}
            t = {ckpt.stored_name(n): ckpt.get(n) for n in names}
            up, down = (ckpt.stored_name(ckpt.expert_module(layer, e, p) + ".weight")[:-len(".weight")]
                        for p in ("up", "down"))
            n_req = permute_expert(t, up, down, perms[(layer, e)], requantize, permute_down)
            requantized += n_req if down + ".weight" in mine else 0
            tensors.update({k: v for k, v in t.items() if k in mine})
        save_file(tensors, out / shard.name, metadata=meta)
    return requantized


def order_checkpoint(model_dir, ids: list[int], out, order: str = "coactivation", requantize: bool = False,
                     seed: int = 0, permute_down: bool = True) -> dict:
    """Calibrate on ids, order every routed expert, write the permuted checkpoint; returns the summary
    (also written to out/coactivation.json)."""
    from nemotron.checkpoint import Checkpoint
    ckpt = Checkpoint(model_dir)
    cfg = ckpt.config
    down0 = ckpt.expert_module(cfg.moe_layers[0], 0, "down") + ".weight"
    if ckpt.info(down0)[0] == "U8" and not requantize and order != "identity":
        raise NeedsRequantize(f"{model_dir}: " + _needs_requantize(down0[:-len(".weight")]))
    fired = record_firing(model_dir, ids)
    gen = torch.Generator().manual_seed(seed)
    I = cfg.moe_intermediate_size
    perms, before, after = {}, dict.fromkeys((16, 8, 4, 2, 1), 0), dict.fromkeys((16, 8, 4, 2, 1), 0)
    for layer in cfg.moe_layers:
        for e in range(cfg.n_routed_experts):
            f = fired.get((layer, e))
            perm = make_order(order, f, I, gen)
            perms[(layer, e)] = perm
            if f is not None:
                for n in before:
                    before[n] += groups_read(f, torch.arange(I), n)
                    after[n] += groups_read(f, perm, n)
    requantized = write_permuted(model_dir, out, perms, requantize, permute_down)
    summary = dict(model=str(model_dir), order=order, calibration_tokens=len(ids), requantized_down=requantized,
                   calibration_groups_read={"unordered": before, "ordered": after},
                   experts_seen=len(fired), experts=cfg.n_routed_experts * len(cfg.moe_layers),
                   perms={f"{layer}.{e}": p.tolist() for (layer, e), p in perms.items()})
    (Path(out) / SUMMARY).write_text(json.dumps(summary) + "\n")
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.coactivation", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path, help="checkpoint directory (hub layout)")
    ap.add_argument("--text-file", required=True, type=Path, help="calibration text (the checkpoint's tokenizer)")
    ap.add_argument("--out", required=True, type=Path, help="new directory for the permuted checkpoint")
    ap.add_argument("--order", choices=ORDERS, default="coactivation")
    ap.add_argument("--requantize", action="store_true",
                    help="allow re-encoding NVFP4 down projections (lossy; required for NVFP4 checkpoints)")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0, help="for --order random")
    a = ap.parse_args(argv)
    from tokenizers import Tokenizer

    from nemotron.checkpoint import CheckpointError
    from nemotron.config import ConfigError
    try:
        tj = a.model / "tokenizer.json"
        if not tj.exists():
            raise ValueError(f"{a.model}: no tokenizer.json to tokenize {a.text_file}")
        ids = Tokenizer.from_file(str(tj)).encode(a.text_file.read_text()).ids[:a.max_tokens]
        if not ids:
            raise ValueError(f"{a.text_file}: no tokens")
        s = order_checkpoint(a.model, ids, a.out, a.order, a.requantize, a.seed)
    except (ValueError, CheckpointError, ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    b, o = s["calibration_groups_read"]["unordered"], s["calibration_groups_read"]["ordered"]
    print(f"{a.out}: {s['order']} order of {s['experts_seen']}/{s['experts']} experts seen in "
          f"{len(ids)} calibration tokens; {s['requantized_down']} down tensors requantized")
    for n in b:
        print(f"  {n:>2}-neuron groups read on the calibration text: {b[n]:>9} -> {o[n]:>9} "
              f"({o[n] / max(b[n], 1):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())


# ---------------------------------------------------------------- batched, on the device (the main instrument)
# The functions above order one expert at a time on the CPU: at I = 672 (42 groups) x 128 experts x 9 layers
# the pairwise swaps alone are ~10^3 small tensor ops per expert and pass. These order every expert of a
# layer at once: `fired` is bool [E, T, n], each expert's routed tokens padded with all-zero rows (a row that
# fires nothing adds to no union, so padding changes no count), and the swap gains come from one batched
# matmul instead of a loop over group pairs.

def _exact_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched a @ b of 0/1 float32 tensors. TF32 keeps 0/1 inputs exact and accumulates in fp32, so counts are
    exact up to 2^24 tokens either way."""
    return torch.bmm(a, b)


def batched_unions(fired: torch.Tensor, perm: torch.Tensor, size: int) -> torch.Tensor:
    """Per expert, (tokens x groups of `size`) with a firing neuron under perm: int64 [E]."""
    E, T, n = fired.shape
    f = torch.gather(fired, 2, perm[:, None, :].expand(E, T, n))
    return f.view(E, T, n // size, size).any(-1).sum((1, 2))


def batched_greedy(F: torch.Tensor, size: int) -> torch.Tensor:
    """_greedy_groups for every expert at once: F float 0/1 [B, T, n], n % size == 0 -> order int64 [B, n]
    (groups of `size` consecutive positions, each in the order its columns joined)."""
    B, T, n = F.shape
    if n % size:
        raise ValueError(f"batched_greedy: {n} neurons do not split into groups of {size}")
    dev = F.device
    freq = F.sum(1)
    tie = freq / (T + 1)
    free = torch.ones(B, n, dtype=torch.bool, device=dev)
    out = torch.empty(B, n, dtype=torch.long, device=dev)
    ar = torch.arange(B, device=dev)
    neg, inf = torch.tensor(-1.0, device=dev), torch.tensor(float("inf"), device=dev)
    pos = 0
    for _ in range(n // size):
        seed = torch.where(free, freq, neg).argmax(1)
        out[:, pos], pos = seed, pos + 1
        free[ar, seed] = False
        union = F[ar, :, seed]                                         # [B, T]
        for _ in range(size - 1):
            added = freq - _exact_mm(union[:, None, :], F)[:, 0]
            j = torch.where(free, added - tie, inf).argmin(1)
            out[:, pos], pos = j, pos + 1
            free[ar, j] = False
            union = torch.maximum(union, F[ar, :, j])
    return out


def swap_gains(F: torch.Tensor, size: int) -> torch.Tensor:
    """delta [B, n, n]: the change of the summed unions (groups of `size` consecutive columns of F) when column
    i and column j trade groups. With rest_i[t] = the other columns of i's group firing at token t, i's group
    after the trade fires at t iff rest_i[t] > 0 or F[t, j]; so its union is R_i + M[i, j] with R_i = #(rest_i
    > 0) and M = [rest == 0]^T F, one matmul for every pair at once. Same-group entries are meaningless
    (callers mask them)."""
    B, T, n = F.shape
    G = n // size
    c = F.view(B, T, G, size).sum(-1)                                 # [B, T, G]
    U = (c > 0).sum(1).float()                                        # [B, G]
    rest = c.repeat_interleave(size, -1) - F                          # [B, T, n]
    R = (rest > 0).sum(1).float()                                     # [B, n]
    M = _exact_mm((rest == 0).float().transpose(1, 2), F)            # [B, n, n]
    Ug = U.repeat_interleave(size, -1)                                # [B, n]: the union of i's group
    new = R[:, :, None] + M                                           # i's group with j in place of i
    return new + new.transpose(1, 2) - Ug[:, :, None] - Ug[:, None, :]


def batched_refine(fired: torch.Tensor, perm: torch.Tensor, size: int, parent: int | None = None,
                   max_iters: int = 200, rounds: int = 4) -> tuple[torch.Tensor, int]:
    """Pairwise swaps between groups of `size` (only between groups inside one block of `parent` positions,
    so a finer level keeps the coarser level's groups), every expert at once: per iteration the best trade
    of each pair of groups, then up to `rounds` rounds of mutually-best pairs (disjoint, so their gains add),
    until no trade gains or max_iters. -> (perm, iterations run)."""
    E, T, n = fired.shape
    parent = n if parent is None else parent
    G, s = n // size, size
    dev = fired.device
    grp = torch.arange(n, device=dev) // size
    allowed = (grp[:, None] != grp[None, :]) & ((torch.arange(n, device=dev)[:, None] // parent)
                                                == (torch.arange(n, device=dev)[None, :] // parent))
    perm = perm.clone()
    it = 0
    for it in range(1, max_iters + 1):
        F = torch.gather(fired, 2, perm[:, None, :].expand(E, T, n)).float()
        d = swap_gains(F, size).masked_fill(~allowed, float("inf"))
        d = d.view(E, G, s, G, s).permute(0, 1, 3, 2, 4).reshape(E, G, G, s * s)
        D, where = d.min(-1)                                          # [E, G, G] best trade per pair of groups
        D = torch.where(D < -0.5, D, torch.full_like(D, float("inf")))
        if not bool(torch.isfinite(D).any()):
            break
        for _ in range(rounds):
            val, best = D.min(-1)                                     # [E, G]
            gi = torch.arange(G, device=dev).expand(E, G)
            mutual = (torch.gather(best, 1, best) == gi) & torch.isfinite(val) & (gi < best)
            if not bool(mutual.any()):
                break
            e_i, a = torch.where(mutual)
            b = best[e_i, a]
            k = where[e_i, a, b]
            pa, pb = a * s + k // s, b * s + k % s
            va, vb = perm[e_i, pa].clone(), perm[e_i, pb].clone()
            perm[e_i, pa], perm[e_i, pb] = vb, va
            used = torch.zeros(E, G, dtype=torch.bool, device=dev)
            used[e_i, a] = True
            used[e_i, b] = True
            D = D.masked_fill(used[:, :, None] | used[:, None, :], float("inf"))
    return perm, it


def batched_order(fired: torch.Tensor, levels=SUB_GROUPS, max_iters: int = 200) -> tuple[torch.Tensor, dict]:
    """coactivation_order for every expert of a layer at once: bool [E, T, n] -> (perm int64 [E, n], info).

    Level levels[0]: per expert the better (fewer calibration unions) of the greedy and the frequency sort,
    then batched_refine; each finer level: the greedy inside each coarser group, then swaps between the groups
    of one coarser group. levels=(4, 2) orders for a store of 4-neuron sub-groups, whose bytes do not depend
    on which 16 neurons share a scale block."""
    E, T, n = fired.shape
    F = fired.float()
    size = levels[0]
    greedy = batched_greedy(F, size)
    freq = torch.sort(F.sum(1), dim=1, descending=True, stable=True).indices
    ug, uf = batched_unions(fired, greedy, size), batched_unions(fired, freq, size)
    perm = torch.where((ug <= uf)[:, None], greedy, freq)
    info = {"greedy_chosen": int((ug <= uf).sum()), "experts": E}
    perm, info[f"iters_{size}"] = batched_refine(fired, perm, size, None, max_iters)
    for parent, sub in zip(levels, levels[1:]):
        G = n // parent
        f = torch.gather(fired, 2, perm[:, None, :].expand(E, T, n)).float()
        f = f.view(E, T, G, parent).permute(0, 2, 1, 3).reshape(E * G, T, parent)
        local = batched_greedy(f, sub).view(E, G, parent) + (torch.arange(G, device=fired.device) * parent)[:, None]
        perm = torch.gather(perm, 1, local.reshape(E, n))
        perm, info[f"iters_{sub}"] = batched_refine(fired, perm, sub, parent, max_iters)
    return perm, info
