"""Issue 15 on the main instrument, in one process on the device: train it, order its BF16 master by
co-activation, quantize to NVFP4 after the order, and measure the down bytes per token and the exactness.

    python -m tools.instrument_downbytes --data CORPUS --out OUT [--preset main] [--seconds 230]
        [--calib-tokens 49152] [--heldout-tokens 24576] [--trace-tokens 16384] [--deadline 420] [TRAIN ARGS]
    python -m tools.instrument_downbytes --report OUT/downbytes.json [--plot OUT.png]

The main instrument's checkpoint (hundreds of MB) cannot leave the device, so nothing here writes one: the
trained model stays in memory (tools.train_instrument.train(keep_model=True)) and every variant is made from
its BF16 rounding (what the hub BF16 checkpoint stores; the trainer's own model, computed in fp32):

- calibration: which ReLU² neurons fire, per (MoE layer, expert), on training-split windows;
- orders (tools.coactivation.batched_order, every expert of a layer at once on the device): `frequency`,
  `coact` (groups of 16, then 8/4/2 inside them: one order for every sub-group size), `coact8`/`coact4`/
  `coact2` (ordered for that sub-group size alone: a store of N-neuron sub-groups reads only N-groups);
- held-out windows through: BF16 unordered (the reference logits), BF16 `coact`-ordered (exact: max relative
  logit difference), the must-fail twin (up rows permuted, down columns not), NVFP4 quantized from the
  unordered master and NVFP4 quantized from the ordered masters (mean KL against BF16, perplexity);
- down (sub-)groups read per token for N = 16/8/4/2/1, in bench.down_groups' counting (a sub-group is read
  when one of its neurons' ReLU² output is non-zero), as bytes of tools.repack's NVFP4 / BF16 blocks
  (kernels.expert_block.ExpertGeometry), for each order: on the physically ordered models from their own
  activations, and on the unordered run with each order applied to its masks (the two agree for BF16, and
  for NVFP4 up to the quantization noise of near-zero neurons);
- routing traces of multi-turn conversations (tools.instrument_stats' rendering of held-out paragraphs) in
  the `--record-routing` format (moe_index, token, experts, next layer's router guess, []) from the NVFP4
  model run over each conversation (causal: the routing a token-by-token decode of the same text chooses).

Written under OUT: downbytes.json (rewritten after each stage: a stage cut off by the deadline leaves the
earlier ones), downbytes.txt (the table), routing-instrument-main.msgpack, main_loss.jsonl.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

NS = (16, 8, 4, 2, 1)
ORDERS = {"coact": (16, 8, 4, 2), "coact8": (8, 4, 2), "coact4": (4, 2), "coact2": (2,)}
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f} s] {msg}", flush=True)


# ---------------------------------------------------------------- the model's weights

@torch.no_grad()
def round_to_hub_bf16_(model) -> None:
    """The BF16 checkpoint's values (tools.instrument_hub.write_checkpoint's storage dtypes), kept in fp32."""
    from tools.instrument_hub import BF, linear_modules, other_tensors
    for t, dt in other_tensors(model).values():
        t.copy_(t.to(dt).float())
    for w in linear_modules(model).values():
        w.copy_(w.to(BF).float())


@torch.no_grad()
def quantize_nvfp4_(model) -> int:
    """Every Linear that the hub NVFP4 layout stores in NVFP4 (routed and shared experts, latent and most Mamba
    projections) replaced by its ModelOpt-exact encode-then-decode (weights only: the engine's NVFP4 path
    dequantizes the weights and keeps activations in bf16/fp32). Returns how many were quantized."""
    from kernels.nvfp4 import decode_nvfp4, encode_nvfp4
    from tools.instrument_hub import hub_config, linear_modules
    from tools.synth import module_formats
    fmts = module_formats(hub_config(model.cfg, "nvfp4"), "nvfp4")
    n = 0
    for name, w in linear_modules(model).items():
        if fmts.get(name) == "nvfp4":
            packed, scale, g = encode_nvfp4(w)
            w.copy_(decode_nvfp4(packed, scale, g).to(w.device))
            n += 1
    return n


@torch.no_grad()
def permute_experts_(model, perms: dict[int, torch.Tensor], permute_down: bool = True) -> None:
    """Every routed expert's neurons reordered: up rows and down columns by the same permutation (exact);
    permute_down=False is the must-fail twin. perms: MoE index -> int64 [E, I] (new position p holds p[e, p])."""
    for j, m in enumerate(model.moes()):
        p = perms[j].to(m.up.device)
        E, I, L = m.up.shape
        m.up.copy_(torch.gather(m.up, 1, p[:, :, None].expand(E, I, L)))
        if permute_down:
            m.down.copy_(torch.gather(m.down, 2, p[:, None, :].expand(E, m.down.shape[1], I)))


# ---------------------------------------------------------------- running it, with the masks recorded

class Masks:
    """Per MoE index: which neurons fire (ReLU² output != 0) for each routed (token, expert) pair."""

    def __init__(self, model, cap: int | None = None):
        self.model, self.cap = model, cap
        self.rows: dict[int, list] = {}
        self.n_e: dict[tuple[int, int], int] = {}

    def __enter__(self):
        for j, m in enumerate(self.model.moes()):
            m.expert_path = "loop"
            m.observe = lambda key, x, j=j: self._note(j, key, x)
        return self

    def __exit__(self, *exc):
        for m in self.model.moes():
            m.observe = None

    def _note(self, j, key, x):
        kind, e = key
        if kind != "down":
            return
        if self.cap is not None:     # the calibration keeps at most cap tokens per expert
            have = self.n_e.get((j, e), 0)
            x = x[: max(self.cap - have, 0)]
            self.n_e[(j, e)] = have + x.shape[0]
            if not x.shape[0]:
                return
        self.rows.setdefault(j, []).append((e, x != 0))

    def layer(self, j) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert id int64 [P], fired bool [P, I]) of MoE index j."""
        parts = self.rows.get(j, [])
        if not parts:
            return torch.zeros(0, dtype=torch.long), torch.zeros(0, 0, dtype=torch.bool)
        eid = torch.cat([torch.full((r.shape[0],), e, dtype=torch.long, device=r.device) for e, r in parts])
        return eid, torch.cat([r for _, r in parts])

    def padded(self, j, E: int) -> torch.Tensor:
        """bool [E, T_max, I]: each expert's rows, padded with rows that fire nothing (no union grows)."""
        eid, f = self.layer(j)
        counts = torch.bincount(eid, minlength=E)
        T = max(int(counts.max()), 1)
        order = torch.argsort(eid, stable=True)
        pos = torch.arange(eid.numel(), device=eid.device) - (torch.cumsum(counts, 0) - counts)[eid[order]]
        out = torch.zeros(E, T, f.shape[1], dtype=torch.bool, device=f.device)
        out[eid[order], pos] = f[order]
        return out


@torch.no_grad()
def forward_windows(model, windows: torch.Tensor, chunk: int, masks: Masks | None = None,
                    keep_logits: bool = False, ref: torch.Tensor | None = None) -> dict:
    """Windows [n, S+1] through the model in fp32: the next-token NLL, and against the reference logits `ref`
    ([n, S, V]) the mean KL(ref ‖ model) and the max relative logit difference."""
    nll = kl = 0.0
    n = 0
    diff = ref_max = 0.0
    logits_out = []
    ctx = masks if masks is not None else _Null()
    with ctx:
        for s in range(0, windows.shape[0], chunk):
            x = windows[s:s + chunk]
            lg = model(x[:, :-1]).float()
            lp = torch.log_softmax(lg.double(), -1)
            nll += float(-lp.gather(-1, x[:, 1:, None]).sum())
            n += x[:, 1:].numel()
            if ref is not None:
                r = ref[s:s + chunk]
                lr = torch.log_softmax(r.double(), -1)
                kl += float((lr.exp() * (lr - lp)).sum())
                diff = max(diff, float((lg - r).abs().max()))
                ref_max = max(ref_max, float(r.abs().max()))
            if keep_logits:
                logits_out.append(lg)
    out = {"tokens": n, "nll": nll / n, "ppl": math.exp(nll / n)}
    if ref is not None:
        out.update(kl_mean=kl / n, max_rel_logit_diff=diff / max(ref_max, 1e-30))
    if keep_logits:
        out["logits"] = logits_out
    return out


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def group_counts(masks: Masks, n_moe: int, perms: dict[str, dict[int, torch.Tensor] | None]) -> dict:
    """order name -> {N: (token, expert) sub-groups with a firing neuron, summed}; perms[name] maps the masks'
    columns (None: as they are). Plus the pairs and the active neurons (the same for every order)."""
    out = {name: dict.fromkeys(NS, 0) for name in perms}
    pairs = active = 0
    per_layer = []
    for j in range(n_moe):
        eid, f = masks.layer(j)
        if not eid.numel():
            per_layer.append(None)
            continue
        P, I = f.shape
        pairs += P
        a = int(f.sum())
        active += a
        g16 = int(f.view(P, -1, 16).any(-1).sum())
        per_layer.append({"pairs": P, "zero_fraction": 1 - a / (P * I), "groups16_active": g16 / (P * I // 16)})
        for name, pm in perms.items():
            g = f if pm is None else torch.gather(f, 1, pm[j].to(f.device)[eid])
            for n in NS:
                out[name][n] += int(g.view(P, -1, n).any(-1).sum())
    return {"groups": out, "pairs": pairs, "active_neurons": active, "per_layer": per_layer}


def bytes_table(counts: dict, tokens: int, L: int, I: int, fmt: str) -> dict:
    """order -> {N: down bytes per token}, and the ratio to the unordered 16-groups."""
    from kernels.expert_block import ExpertGeometry
    gb = {n: ExpertGeometry(L, I, fmt, n).group_bytes for n in NS}
    per = {name: {n: c[n] * gb[n] / tokens for n in NS} for name, c in counts["groups"].items()}
    base = per.get("identity", next(iter(per.values())))[16]
    return {"bytes_per_token": per, "vs_unordered_16": {name: {n: v / base for n, v in d.items()}
                                                        for name, d in per.items()}}


class RouteReplay:
    """Records every router choice of one run (in call order) and replays it in a later run of the same
    windows: the experts are the recorded ones, the weights this run's own scores at them. An fp32 difference
    as small as a reordered sum can flip a near-tie in a router's top-k, and one flipped expert moves that
    token's logits by far more than rounding; replaying the choice separates the two."""

    def __init__(self):
        self.log: list[torch.Tensor] = []
        self.mode, self.i = None, 0

    def __enter__(self):
        import tools.instrument_model as im
        self._orig = im.route
        im.route = self._route
        self.i = 0
        return self

    def __exit__(self, *exc):
        import tools.instrument_model as im
        im.route = self._orig

    def _route(self, logits, bias, k, n_group, topk_group, norm_topk_prob, scaling):
        if self.mode == "record":
            idx, w = self._orig(logits, bias, k, n_group, topk_group, norm_topk_prob, scaling)
            self.log.append(idx)
            return idx, w
        idx = self.log[self.i]
        self.i += 1
        w = torch.sigmoid(logits).gather(1, idx)
        if norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * scaling


def routing_flips(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    """Two runs' router choices (RouteReplay logs of the same windows): (token, MoE layer) rows whose expert set
    differs, and how many rows there are."""
    diff = sum(int((torch.sort(x, -1).values != torch.sort(y, -1).values).any(-1).sum()) for x, y in zip(a, b))
    return {"rows_differing": diff, "rows": sum(x.shape[0] for x in a)}


# ---------------------------------------------------------------- routing traces

@torch.no_grad()
def record_routing(model, convs: list[list[int]], path: Path, device, deadline: float) -> dict:
    """The `--record-routing` records of each conversation run through the model: per token and MoE layer the
    chosen experts and the next MoE layer's router on this layer's input (the last layer's: the first's, for
    the next token), as nemotron.model.NemotronH guesses."""
    from gpu_worker.streaming import RoutingRecorder
    from tools.instrument_model import route
    moes = model.moes()
    got: dict[int, tuple] = {}
    hooks = []
    for j, m in enumerate(moes):
        nxt = moes[(j + 1) % len(moes)]

        def pre(mod, args, j=j, m=m, nxt=nxt):
            h = args[0].reshape(-1, args[0].shape[-1]).float()
            ex, _ = route(h @ m.gate.float().T, m.e_score_correction_bias, m.k, m.n_group, m.topk_group,
                          m.norm_topk_prob, m.scaling)
            gs, _ = route(h @ nxt.gate.float().T, nxt.e_score_correction_bias, nxt.k, nxt.n_group, nxt.topk_group,
                          nxt.norm_topk_prob, nxt.scaling)
            got[j] = (ex.cpu().tolist(), gs.cpu().tolist())
        hooks.append(m.register_forward_pre_hook(pre))
    w = RoutingRecorder(path)
    tok = convs_done = 0
    try:
        for ids in convs:
            if time.time() > deadline:
                break
            got.clear()
            model(torch.tensor([ids], device=device))
            for t in range(len(ids)):
                for j in range(len(moes)):
                    w(j, tok, got[j][0][t], got[j][1][t], [])
                tok += 1
            convs_done += 1
    finally:
        w.close()
        for h in hooks:
            h.remove()
    return {"tokens": tok, "conversations": convs_done, "path": path.name}


# ---------------------------------------------------------------- the run

def table(res: dict) -> str:
    out = []
    s = res.get("train", {})
    if s:
        out.append(f"trained {s.get('steps')} steps, {s.get('tokens', 0) / 1e6:.1f} M tokens in "
                   f"{s.get('train_seconds')} s; held-out loss {s.get('final_heldout_loss', float('nan')):.3f}")
    sp = res.get("sparsity")
    if sp:
        out.append(f"held-out {res['heldout_tokens']} tokens: ReLU² zeros {sp['zero_fraction']:.1%}, "
                   f"16-groups active {sp['groups16_active']:.1%}; calibration {res.get('calib_tokens')} tokens")
    for key, title in (("nvfp4", "NVFP4 store"), ("bf16", "BF16 store")):
        b = res.get("bytes", {}).get(key)
        if not b:
            continue
        out.append(f"{title}: down bytes per token, ratio to the unordered 16-neuron groups "
                   f"({b['bytes_per_token']['identity'][16]:,.0f} B/token)")
        out.append(f"{'order':>22} " + " ".join(f"{f'N={n}':>7}" for n in NS))
        for name, d in b["vs_unordered_16"].items():
            out.append(f"{name:>22} " + " ".join(f"{d[n]:>7.3f}" for n in NS))
    if res.get("block_bytes"):
        out.append("block bytes (NVFP4) vs N=16: "
                   + ", ".join(f"N={n}: {v:.3f}" for n, v in res["block_vs_16"].items()))
    ex = res.get("exactness", {})
    if ex:
        out.append("exactness on the held-out windows (against the BF16 unordered model):")
        for name, d in ex.items():
            out.append(f"{name:>28}: ppl {d['ppl']:.4f}  KL {d.get('kl_mean', 0):.3e} nats  "
                       f"max rel logit diff {d.get('max_rel_logit_diff', 0):.2e}")
    if res.get("routing_flips"):
        f = res["routing_flips"]
        out.append(f"routing, ordered vs unordered BF16: {f['rows_differing']} of {f['rows']} (token, MoE layer) "
                   f"rows choose other experts")
    if res.get("trace"):
        out.append(f"routing trace: {res['trace']['tokens']} tokens, {res['trace']['conversations']} conversations")
    out.append(f"stages: {', '.join(f'{k} {v:.0f} s' for k, v in res.get('stage_seconds', {}).items())}")
    return "\n".join(out)


def run(a) -> dict:
    from tools import train_instrument as ti
    global T0
    # the deadline counts from this call, not from the import (a test session imports the module minutes before it
    # runs it; the device script's own `timeout` leaves room for the import)
    T0 = time.time()
    dev = torch.device(a.device)
    deadline = T0 + a.deadline
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, "stage_seconds": {}}

    def save(stage, t):
        res["stage_seconds"][stage] = time.time() - t
        (out / "downbytes.json").write_text(json.dumps(res, indent=1) + "\n")
        (out / "downbytes.txt").write_text(table(res) + "\n")
        log(f"{stage} done in {time.time() - t:.1f} s")

    # 1. train (or read a checkpoint: --model, e.g. the committed instrument-tiny on a CPU)
    t = time.time()
    if a.model:
        from tools.instrument_hub import load_checkpoint
        model = load_checkpoint(a.model, dev)
        res["model"] = str(a.model)
    else:
        targs = ti.parser().parse_args(["--data", str(a.data), "--preset", a.preset, "--seconds", str(a.seconds),
                                        "--device", a.device, "--seq-len", str(a.seq_len),
                                        "--log", str(out / "main_loss.jsonl"), *a.train_args])
        summary, model = ti.train(targs, keep_model=True)
        res["train"] = {k: summary.get(k) for k in ("steps", "tokens", "train_seconds", "final_heldout_loss",
                                                     "final_heldout_ppl", "tok_per_s", "params", "active_params",
                                                     "expert_path", "batch")}
    model.zero_grad(set_to_none=True)
    model.eval().float()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    round_to_hub_bf16_(model)
    master = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = model.cfg
    n_moe, E, I = len(model.moes()), cfg.n_routed_experts, cfg.moe_intermediate_size
    L = cfg.moe_latent_size or cfg.hidden_size
    save("train", t)

    def fresh(perms=None, permute_down=True, nvfp4=False):
        model.load_state_dict(master)
        if perms is not None:
            permute_experts_(model, perms, permute_down)
        if nvfp4:
            quantize_nvfp4_(model)
        return model

    # exactness runs want plain fp32: TF32 would round each product to 10 mantissa bits
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    # 2. calibrate on training-split windows
    t = time.time()
    seq = a.seq_len
    train_tokens = ti.load_tokens(Path(a.data) / "train.u16")
    held_tokens = ti.load_tokens(Path(a.data) / "heldout.u16")
    calib = ti.Batches(train_tokens, seq, dev, a.seed + 7).sample(max(1, a.calib_tokens // seq))
    held = ti.Batches(held_tokens, seq, dev, 0).fixed(max(1, a.heldout_tokens // seq))
    res.update(calib_tokens=int(calib[:, :-1].numel()), heldout_tokens=int(held[:, :-1].numel()))
    cm = Masks(model, cap=a.calib_cap)
    forward_windows(model, calib, a.chunk, masks=cm)
    save("calibrate", t)

    # 3. orders, every expert of a layer at once
    t = time.time()
    small = f"coact4-cal{a.calib_cap // 4}"     # the same order fitted on a quarter of the calibration
    orders = {name: ORDERS[name] for name in a.orders}
    perms: dict[str, dict[int, torch.Tensor]] = {name: {} for name in ("frequency", *orders)
                                                 if name in orders or name == "frequency"}
    if "coact4" in orders:
        perms[small] = {}
    insample = {name: dict.fromkeys(NS, 0) for name in ("identity", *perms)}
    order_info = {name: [] for name in orders}
    from tools.coactivation import batched_order, batched_unions
    torch.backends.cuda.matmul.allow_tf32 = True     # 0/1 operands: TF32 is exact here, and 8x faster
    for j in range(n_moe):
        fired = cm.padded(j, E)
        ident = torch.arange(I, device=fired.device).expand(E, I).contiguous()
        perms["frequency"][j] = torch.sort(fired.float().sum(1), dim=1, descending=True, stable=True).indices
        for name, levels in orders.items():
            # past the stage's budget the swaps get a few passes only (the greedy start is kept whole)
            iters = a.refine_iters if time.time() - t < a.order_seconds else 3
            p, info = batched_order(fired, levels, max_iters=iters)
            perms[name][j] = p
            order_info[name].append(info)
        if small in perms:
            perms[small][j], _ = batched_order(fired[:, : max(fired.shape[1] // 4, 1)].contiguous(), ORDERS["coact4"],
                                               max_iters=a.refine_iters if time.time() - t < a.order_seconds else 3)
        for name in insample:
            p = ident if name == "identity" else perms[name][j]
            for n in NS:
                insample[name][n] += int(batched_unions(fired, p, n).sum())
        del fired
        log(f"ordered MoE layer {j}")
    del cm
    torch.backends.cuda.matmul.allow_tf32 = False
    res["calibration_groups_ratio"] = {name: {n: d[n] / max(insample["identity"][n], 1) for n in NS}
                                       for name, d in insample.items()}
    res["order_info"] = order_info
    save("order", t)

    def all_perms():
        return {"identity": None, **perms}

    # 4. BF16 unordered: the reference logits and every order's counts on its masks
    t = time.time()
    fresh()
    m0 = Masks(model)
    base = forward_windows(model, held, a.chunk, masks=m0, keep_logits=True)
    ref = torch.cat(base.pop("logits"))
    c_bf16 = group_counts(m0, n_moe, all_perms())
    del m0
    T = res["heldout_tokens"]
    res["sparsity"] = {"zero_fraction": 1 - c_bf16["active_neurons"] / max(c_bf16["pairs"] * I, 1),
                       "groups16_active": c_bf16["groups"]["identity"][16] / max(c_bf16["pairs"] * I // 16, 1),
                       "per_layer": c_bf16["per_layer"]}
    res["bytes"] = {"bf16": bytes_table(c_bf16, T, L, I, "bf16")}
    res["exactness"] = {"bf16 unordered": base}
    from kernels.expert_block import ExpertGeometry
    bb = {n: ExpertGeometry(L, I, "nvfp4", n).block_bytes for n in NS}
    res["block_bytes"], res["block_vs_16"] = bb, {n: bb[n] / bb[16] for n in NS}
    save("bf16_unordered", t)

    # 5. BF16 ordered (exact) and the twin (up only: must be far off)
    t = time.time()
    fresh(perms["coact"])
    mo = Masks(model)
    r = forward_windows(model, held, a.chunk, masks=mo, ref=ref)
    own = group_counts(mo, n_moe, {"coact (ordered model)": None})
    del mo
    res["exactness"]["bf16 coact-ordered"] = r
    res["bytes"]["bf16_ordered_model"] = bytes_table(
        {"groups": {"identity": c_bf16["groups"]["identity"], **own["groups"]}}, T, L, I, "bf16")
    fresh(perms["coact"], permute_down=False)
    res["exactness"]["twin: up permuted, down not"] = forward_windows(model, held, a.chunk, ref=ref)
    save("bf16_ordered", t)
    if a.floor:
        t = time.time()
        fresh()     # the noise floor: the same model, another batch shape (other GEMM tilings and sums)
        res["exactness"]["bf16 unordered, 1 window per forward"] = forward_windows(model, held, 1, ref=ref)
        replay, ordered = RouteReplay(), RouteReplay()
        with ordered:          # the ordered model's own choices, to count where they differ
            ordered.mode = "record"
            fresh(perms["coact"])
            forward_windows(model, held, a.chunk)
        with replay:
            replay.mode = "record"
            fresh()
            forward_windows(model, held, a.chunk)
            res["routing_flips"] = routing_flips(replay.log, ordered.log)
            fresh(perms["coact"])
            replay.mode, replay.i = "replay", 0
            res["exactness"]["bf16 coact-ordered, routing replayed"] = forward_windows(model, held, a.chunk, ref=ref)
            fresh()
            replay.i = 0
            res["exactness"]["bf16 unordered, routing replayed"] = forward_windows(model, held, a.chunk, ref=ref)
        del replay
        fresh()
        with torch.no_grad():
            for m in model.moes():
                m.down.zero_()
        res["exactness"]["routed experts zeroed"] = forward_windows(model, held, a.chunk, ref=ref)
        save("floor", t)

    # 6. NVFP4 from the unordered master, then the routing trace on the same weights
    t = time.time()
    fresh(nvfp4=True)
    mq = Masks(model)
    res["exactness"]["nvfp4 from unordered"] = forward_windows(model, held, a.chunk, masks=mq, ref=ref)
    c_q = group_counts(mq, n_moe, all_perms())
    del mq
    res["bytes"]["nvfp4"] = bytes_table(c_q, T, L, I, "nvfp4")
    save("nvfp4_unordered", t)
    if a.trace_tokens:
        t = time.time()
        from tools.instrument_stats import conversations
        text = (Path(a.data) / "heldout.txt").read_text()
        convs = conversations(text, Path(a.data) / "tokenizer", a.trace_tokens)
        res["trace"] = record_routing(model, convs, out / "routing-instrument-main.msgpack", dev,
                                      min(deadline - a.reserve, time.time() + a.trace_seconds))
        save("trace", t)

    # 7. NVFP4 from the ordered masters: what the store of each order really reads, and its cost
    for name in a.realize:
        if time.time() > deadline - a.reserve:
            log(f"skipping nvfp4 from {name}: deadline")
            continue
        t = time.time()
        fresh(perms[name], nvfp4=True)
        mq = Masks(model)
        res["exactness"][f"nvfp4 from {name}-ordered"] = forward_windows(model, held, a.chunk, masks=mq, ref=ref)
        own = group_counts(mq, n_moe, {f"{name} (ordered model)": None})
        del mq
        res["bytes"]["nvfp4"]["bytes_per_token"].update(bytes_table(
            {"groups": {"identity": c_q["groups"]["identity"], **own["groups"]}}, T, L, I, "nvfp4")["bytes_per_token"])
        base16 = res["bytes"]["nvfp4"]["bytes_per_token"]["identity"][16]
        res["bytes"]["nvfp4"]["vs_unordered_16"] = {k: {n: v / base16 for n, v in d.items()}
                                                    for k, d in res["bytes"]["nvfp4"]["bytes_per_token"].items()}
        save(f"nvfp4_{name}", t)
    res["perms_sha"] = {name: _digest(p) for name, p in perms.items()}
    save("end", time.time())
    return res


def plot(res: dict, path: Path) -> None:
    """Down bytes per token vs N (NVFP4 store) for every order, the block bytes beside them."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    nv = res["bytes"]["nvfp4"]["vs_unordered_16"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, d in nv.items():
        ns = [int(n) for n in d]
        ax.plot(ns, list(d.values()), marker="o", ls="--" if "ordered model" in name else "-", label=name)
    bb = res["block_vs_16"]
    ax.plot([int(n) for n in bb], list(bb.values()), color="grey", marker="s", lw=1, label="block bytes on disk")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.invert_xaxis()
    ax.axhline(0.5, color="k", lw=0.8, ls=":")
    ax.set_xlabel("neurons per down sub-group (N)")
    ax.set_ylabel("down bytes / token vs unordered 16-groups")
    sp = res.get("sparsity", {})
    ax.set_title(f"main instrument, NVFP4 store, held-out {res.get('heldout_tokens')} tokens "
                 f"({sp.get('zero_fraction', 0):.1%} zeros)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _int_keys(x):
    """JSON's string keys "16", "8", ... back to the ints the tables index by."""
    if isinstance(x, dict):
        return {(int(k) if isinstance(k, str) and k.isdigit() else k): _int_keys(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_int_keys(v) for v in x]
    return x


def _digest(p: dict[int, torch.Tensor]) -> str:
    import hashlib
    h = hashlib.sha256()
    for j in sorted(p):
        h.update(p[j].cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--report":      # --report downbytes.json [--plot OUT.png]: table (and plot) again
        res = _int_keys(json.loads(Path(argv[1]).read_text()))
        print(table(res))
        if "--plot" in argv:
            plot(res, Path(argv[argv.index("--plot") + 1]))
        return 0
    ap = argparse.ArgumentParser(prog="python -m tools.instrument_downbytes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, type=Path, help="corpus (train.u16[.xz], heldout.u16/.txt, tokenizer/)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--preset", default="main")
    ap.add_argument("--model", type=Path, help="measure this hub checkpoint instead of training one")
    ap.add_argument("--seconds", type=float, default=230, help="training budget")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq-len", type=int, default=1024, help="calibration / held-out window length")
    ap.add_argument("--chunk", type=int, default=4, help="windows per forward")
    ap.add_argument("--calib-tokens", type=int, default=49152)
    ap.add_argument("--calib-cap", type=int, default=4096, help="calibration tokens kept per expert")
    ap.add_argument("--heldout-tokens", type=int, default=24576)
    ap.add_argument("--refine-iters", type=int, default=200, help="swap iterations per level at most")
    ap.add_argument("--order-seconds", type=float, default=70, help="after this long, 3 swap iterations per level")
    ap.add_argument("--realize", default="coact,coact4,coact2",
                    help="orders whose ordered master is quantized to NVFP4 and run (comma-separated)")
    ap.add_argument("--orders", default=",".join(ORDERS), help="co-activation orders to fit (comma-separated; "
                    "coact is always fitted: the exactness runs use it)")
    ap.add_argument("--floor", action="store_true", help="also: the fp32 noise floor (another batch shape), the "
                    "ordered model with the unordered run's routing replayed, and the routed experts zeroed")
    ap.add_argument("--trace-tokens", type=int, default=16384)
    ap.add_argument("--trace-seconds", type=float, default=40)
    ap.add_argument("--deadline", type=float, default=440, help="seconds from the start: later stages are skipped")
    ap.add_argument("--reserve", type=float, default=25, help="seconds a stage must have left to start")
    ap.add_argument("--seed", type=int, default=0)
    a, rest = ap.parse_known_args(argv)
    a.train_args = rest
    a.realize = [r for r in a.realize.split(",") if r]
    a.orders = list(dict.fromkeys(["coact", *(o for o in a.orders.split(",") if o)]))
    bad = [r for r in a.realize + a.orders if r not in ORDERS or (r in a.realize and r not in a.orders)]
    if bad:
        ap.error(f"--orders / --realize: unknown or not fitted order(s) {bad} (one of {', '.join(ORDERS)})")
    res = run(a)
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
