"""Train the instrument: a NemotronH with Super's structure on the Debian documentation corpus.

    python -m tools.train_instrument --data CORPUS --preset main|tiny|test --seconds S --out DIR
        [--device cuda] [--seq-len 1024] [--batch-tokens 65536] [--lr 1.5e-3] [--log loss.jsonl]

CORPUS is what tools.instrument_corpus wrote (train.u16 / heldout.u16, optionally .xz; tokenizer/). The
run is budgeted in wall-clock seconds, not steps: the learning rate warms up over the first steps, stays
flat, and decays linearly to 10 % over the last quarter of the budget (warmup-stable-decay), so a run ends
on time whatever the throughput turns out to be. After each step the routers' `e_score_correction_bias`
moves by `--bias-rate` toward balance (aux-loss-free, as NVIDIA trains Nemotron 3), with a small
sequence-level balance loss beside it (`--aux-coeff`). The loss curve (train and held-out) is printed and
written as JSON lines; DIR gets `bf16/` and `nvfp4/` checkpoints in the hub layout and `summary.json`.
"""
from __future__ import annotations

import argparse
import json
import lzma
import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tools.instrument_model import InstrumentConfig, InstrumentLM, grouped_mm_available

PRESETS = {
    # Super's layout shortened to 20 layers (9 Mamba, 9 MoE, 2 attention), Super's ratios at hidden 768
    "main": InstrumentConfig(),
    # the test checkpoint (tests/data/instrument-tiny, <= 10 MB in NVFP4); grouped top-k on
    "tiny": InstrumentConfig(hidden_size=128, pattern="MEMEM*EME", num_attention_heads=4, num_key_value_heads=2,
                             head_dim=32, mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=32, n_groups=2,
                             chunk_size=64, n_routed_experts=32, num_experts_per_tok=4, moe_intermediate_size=160,
                             moe_latent_size=64, moe_shared_expert_intermediate_size=192, n_group=4, topk_group=2),
    # a seconds-long CPU smoke run
    "test": InstrumentConfig(hidden_size=64, pattern="ME*E", num_attention_heads=2, num_key_value_heads=1,
                             head_dim=32, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
                             chunk_size=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                             moe_latent_size=32, moe_shared_expert_intermediate_size=64, n_group=2, topk_group=1),
}


def load_tokens(path: Path) -> np.ndarray:
    xz = path.with_name(path.name + ".xz")
    if path.exists():
        return np.fromfile(path, dtype="<u2")
    if xz.exists():
        return np.frombuffer(lzma.decompress(xz.read_bytes()), dtype="<u2")
    raise SystemExit(f"{path}: not found (nor {xz.name}); build it with python -m tools.instrument_corpus")


class Batches:
    """Random windows of seq_len + 1 tokens from one token stream held on the device."""

    def __init__(self, tokens: np.ndarray, seq_len: int, device, seed: int):
        self.data = torch.from_numpy(tokens.astype(np.int64)).to(device)
        self.seq_len, self.device = seq_len, device
        self.g = torch.Generator(device=device).manual_seed(seed)
        self.ar = torch.arange(seq_len + 1, device=device)

    def sample(self, b: int) -> torch.Tensor:
        starts = torch.randint(0, self.data.numel() - self.seq_len - 1, (b, 1), generator=self.g, device=self.device)
        return self.data[starts + self.ar]

    def fixed(self, b: int) -> torch.Tensor:
        """b evenly spaced windows (the same every call: the held-out curve)."""
        step = (self.data.numel() - self.seq_len - 1) // max(b, 1)
        starts = torch.arange(b, device=self.device)[:, None] * step
        return self.data[starts + self.ar]


def lr_at(frac: float, step: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    if frac < 0.75:
        return peak
    return peak * (1.0 - 0.9 * min(1.0, (frac - 0.75) / 0.25))


def param_groups(model: InstrumentLM, wd: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "conv1d" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def eval_loss(model, ids: torch.Tensor, autocast, chunk: int = 8) -> float:
    model.eval()
    tot, n = 0.0, 0
    for s in range(0, ids.shape[0], chunk):
        x = ids[s:s + chunk]
        with autocast():
            logits = model(x[:, :-1])
        tot += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"))
        n += x[:, 1:].numel()
    model.train()
    return tot / n


def check_expert_path(model: InstrumentLM, device, path: str) -> str:
    """An expert path against the loop on one MoE layer (outputs and gradients, under bf16 autocast)."""
    moe = model.moes()[0]
    g = torch.Generator(device=device).manual_seed(1)
    h = torch.randn(2, 96, model.cfg.hidden_size, device=device, generator=g)
    outs = []
    for p in ("loop", path):
        moe.expert_path = p
        moe.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = moe(h)
        y.float().square().mean().backward()
        outs.append((y.detach().float(), moe.up.grad.detach().clone(), moe.gate.grad.detach().clone()))
    moe.zero_grad(set_to_none=True)
    moe.expert_path = "loop"
    errs = [float((b - a).norm() / a.norm().clamp_min(1e-30)) for a, b in zip(outs[0], outs[1])]
    return "ok" if max(errs) < 3e-2 else f"mismatch {errs}"


def choose_expert_path(model: InstrumentLM, device, wanted: str) -> tuple[str, dict]:
    """The first of grouped / padded that matches the loop here; the loop otherwise."""
    tried = {}
    for path in (["grouped", "padded"] if wanted == "auto" else [wanted]):
        if path == "loop":
            break
        if path == "grouped" and not grouped_mm_available(device):
            tried[path] = "unavailable"
            continue
        try:
            tried[path] = check_expert_path(model, device, path)
        except Exception as e:     # an older torch or an unsupported shape: the loop is always right
            tried[path] = f"failed: {type(e).__name__}: {e}"[:300]
        if tried[path] == "ok":
            return path, tried
    return "loop", tried


def train(args, keep_model: bool = False):
    """-> the summary; with keep_model, (summary, the trained model) for a caller that measures it in the
    same process (tools.instrument_downbytes: the main model cannot leave the device)."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    data = Path(args.data)
    tok_dir = Path(args.tokenizer) if args.tokenizer else data / "tokenizer"
    vocab = json.loads((tok_dir / "tokenizer.json").read_text())["model"]["vocab"]
    cfg = replace(PRESETS[args.preset], vocab_size=len(vocab))
    train_tokens, held_tokens = load_tokens(data / "train.u16"), load_tokens(data / "heldout.u16")
    if args.max_train_tokens:
        train_tokens = train_tokens[: args.max_train_tokens]
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = InstrumentLM(cfg, train_chunk=args.scan_chunk)
    model.init_weights(args.seed)
    model.train()
    path, tried = ("loop", {}) if args.experts == "loop" else choose_expert_path(
        model, device, args.experts if (cuda or args.experts != "auto") else "loop")
    model.set_expert_path(path)
    n_params = sum(p.numel() for p in model.parameters())
    n_active = model.active_params()
    b = max(1, args.batch_tokens // args.seq_len)
    tr = Batches(train_tokens, args.seq_len, device, args.seed)
    he = Batches(held_tokens, args.seq_len, device, args.seed + 1)
    held_fixed = he.fixed(args.eval_windows)
    opt = torch.optim.AdamW(param_groups(model, args.wd), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            **({"fused": True} if cuda else {}))
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else (
        lambda: torch.autocast("cpu", enabled=False))
    flops_per_token = 6 * n_active
    header = {"preset": args.preset, "config": asdict(cfg), "params": n_params, "active_params": n_active,
              "train_tokens_available": int(train_tokens.size), "heldout_tokens": int(held_tokens.size),
              "batch": [b, args.seq_len], "expert_path": path, "expert_paths_tried": tried, "device": str(device),
              "gpu": torch.cuda.get_device_name(device) if cuda else None, "seconds_budget": args.seconds}
    print(json.dumps(header), flush=True)
    if args.log:
        Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    log = open(args.log, "w") if args.log else None
    if log:
        log.write(json.dumps({"header": header}) + "\n")
    t0 = time.time()
    step, tokens, smooth = 0, 0, None
    curve = []
    while True:
        elapsed = time.time() - t0
        frac = elapsed / args.seconds
        if frac >= 1.0 or (args.max_steps and step >= args.max_steps):
            break
        lr = lr_at(frac, step, args.lr, args.warmup)
        for gr in opt.param_groups:
            gr["lr"] = lr
        x = tr.sample(b)
        with autocast():
            logits = model(x[:, :-1])
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            loss = ce + args.aux_coeff * model.aux_loss().to(ce.device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        for m in model.moes():
            m.update_router_bias(args.bias_rate)
        step += 1
        tokens += x[:, 1:].numel()
        if step % args.log_every == 0 or step == 1:
            ce_v = float(ce.detach())
            smooth = ce_v if smooth is None else 0.9 * smooth + 0.1 * ce_v
            rec = {"step": step, "tokens": tokens, "s": round(time.time() - t0, 1), "loss": round(ce_v, 4),
                   "loss_smooth": round(smooth, 4), "lr": lr, "gnorm": round(float(gnorm), 3)}
            if step % args.eval_every == 0 or step == 1:
                rec["heldout_loss"] = round(eval_loss(model, held_fixed, autocast), 4)
                loads = torch.stack([m.last_counts.float() for m in model.moes()])
                rec["load_max_over_mean"] = round(float((loads.max(1).values / loads.mean(1)).mean()), 2)
            dt = time.time() - t0
            rec["tok_per_s"] = round(tokens / max(dt, 1e-9))
            rec["tflops"] = round(tokens * flops_per_token / max(dt, 1e-9) / 1e12, 1)
            curve.append(rec)
            print(json.dumps(rec), flush=True)
            if log:
                log.write(json.dumps(rec) + "\n")
                log.flush()
    train_s = time.time() - t0
    final_held = eval_loss(model, he.fixed(args.final_eval_windows), autocast)
    summary = {**header, "steps": step, "tokens": tokens, "train_seconds": round(train_s, 1),
               "epochs": round(tokens / max(train_tokens.size, 1), 2), "final_train_loss_smooth": smooth,
               "final_heldout_loss": final_held, "final_heldout_ppl": math.exp(final_held),
               "tok_per_s": round(tokens / max(train_s, 1e-9)),
               "model_tflops": round(tokens * flops_per_token / max(train_s, 1e-9) / 1e12, 1)}
    print(json.dumps({"summary": summary}), flush=True)
    if log:
        log.write(json.dumps({"summary": summary}) + "\n")
        log.close()
    if args.out:
        from tools.instrument_hub import calibrate, write_checkpoint
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        t1 = time.time()
        with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False):
            amax = calibrate(model, [he.fixed(4)[:, :-1]])
        model.float()
        for q in args.quant:
            write_checkpoint(model, out / q, q, tok_dir, amax)
        summary["write_seconds"] = round(time.time() - t1, 1)
        (out / "summary.json").write_text(json.dumps({**summary, "curve": curve}, indent=1) + "\n")
    return (summary, model) if keep_model else summary


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="corpus directory (tools.instrument_corpus --out)")
    ap.add_argument("--tokenizer", help="tokenizer directory (default DATA/tokenizer)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="main")
    ap.add_argument("--seconds", type=float, required=True, help="wall-clock training budget")
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--max-train-tokens", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-tokens", type=int, default=65536)
    ap.add_argument("--scan-chunk", type=int, default=64, help="SSD chunk length in training (math unchanged)")
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--bias-rate", type=float, default=1e-3, help="aux-loss-free router bias update rate")
    ap.add_argument("--aux-coeff", type=float, default=1e-4, help="sequence-level balance loss coefficient")
    ap.add_argument("--experts", choices=["auto", "grouped", "padded", "loop"], default="auto",
                    help="routed-expert implementation (auto: the first of grouped/padded that matches the loop)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--final-eval-windows", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write bf16/ and nvfp4/ hub checkpoints and summary.json here")
    ap.add_argument("--quant", nargs="+", default=["bf16", "nvfp4"], choices=["bf16", "nvfp4"])
    ap.add_argument("--log", help="loss curve as JSON lines")
    return ap


def main(argv=None):
    ap = parser()
    a = ap.parse_args(argv)
    if a.eval_every % a.log_every:
        ap.error("--eval-every must be a multiple of --log-every")
    train(a)


if __name__ == "__main__":
    sys.exit(main())
