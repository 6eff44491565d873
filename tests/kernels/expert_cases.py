"""Random experts for the routed-expert kernel tests: checkpoint tensors, packed blocks, dense references."""
import torch

from kernels.expert_block import ExpertGeometry, pack_expert_block
from kernels.nvfp4 import decode_fp8, decode_nvfp4, encode_fp8, encode_nvfp4

L, I, K = 48, 80, 3  # odd sizes: 3 and 5 groups of 16, not powers of two
TOL = 2e-5


def ckpt(L, I, fmt="nvfp4"):
    """Checkpoint tensors of one expert and its dense fp32 weights (the reference)."""
    up = torch.randn(I, L) * torch.rand(I, 1)
    down = torch.randn(L, I) * torch.rand(L, 1)
    if fmt == "nvfp4":
        uq, us, ug = encode_nvfp4(up)
        dq, ds, dg = encode_nvfp4(down)
        return (uq, us, dq, ds), ug, dg, decode_nvfp4(uq, us, ug), decode_nvfp4(dq, ds, dg)
    if fmt == "fp8":
        uq, ug = encode_fp8(up)
        dq, dg = encode_fp8(down)
        return (uq, None, dq, None), ug, dg, decode_fp8(uq, ug), decode_fp8(dq, dg)
    ub, db = up.bfloat16(), down.bfloat16()
    return (ub, None, db, None), torch.tensor(1.0), torch.tensor(1.0), ub.float(), db.float()


def experts(k=K, L=L, I=I, fmt="nvfp4", device="cpu"):
    """(geometry, blocks, up globals [k], down globals [k], dense ups, dense downs, checkpoint tensors)."""
    geom = ExpertGeometry(L, I, fmt)
    blocks, ug, dg, ups, downs, raw = [], [], [], [], [], []
    for _ in range(k):
        t, u, d, up, down = ckpt(L, I, fmt)
        blocks.append(pack_expert_block(geom, *t).to(device))
        ug.append(u); dg.append(d); ups.append(up); downs.append(down); raw.append(t)
    f = lambda v: torch.stack([torch.as_tensor(e, dtype=torch.float32).reshape(()) for e in v]).to(device)  # noqa
    return geom, blocks, f(ug), f(dg), ups, downs, raw


def dense_ref(x, ups, downs, w):
    acc = torch.zeros(downs[0].shape[0], dtype=torch.float64)
    for j in range(len(ups)):
        a = torch.relu(ups[j].double() @ x.double().cpu()) ** 2
        acc += float(w[j]) * (downs[j].double() @ a)
    return acc


def act_with_active_fraction(frac, k=K, I=I, device="cpu"):
    """ReLU² outputs and their group mask with `frac` of the (expert, group) pairs active."""
    G = I // 16
    n_active = round(frac * k * G)
    mask = torch.zeros(k * G, dtype=torch.int8)
    mask[torch.randperm(k * G)[:n_active]] = 1
    mask = mask.view(k, G)
    act = torch.rand(k, G, 16) + 0.05
    act *= (torch.rand(k, G, 16) > 0.4)          # zeros inside active groups too
    act[:, :, 0] = act[:, :, 0].clamp_min(0.05)  # but each active group holds a non-zero
    act *= mask.unsqueeze(-1)
    return act.view(k, I).to(device), mask.to(device)
