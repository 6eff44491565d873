#!/usr/bin/env bash
# One device call: correctness of the streaming engine on CUDA (tiny model, bf16, vs the CPU fp32 engine),
# then the end-to-end benchmark on a Super-shaped model. Writes everything under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
{ df -h /dev/shm /tmp; nvidia-smi --query-gpu=name,memory.total --format=csv; python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'; } > "$OUT/env.txt" 2>&1
mount -o remount,size=100G /dev/shm 2>/dev/null || true
W=/tmp/w; mkdir -p $W
IDS=$(python3 -c 'import random; random.seed(1); print(",".join(str(random.randrange(14, 1000)) for _ in range(30)))')
{
  python3 -m tools.synth --preset tiny --quant nvfp4 --out $W/tiny >/dev/null 2>&1
  python3 -m tools.repack --model $W/tiny --out $W/tinystore --no-progress >/dev/null 2>&1
  python3 -m tools.logits --model $W/tiny --ids $IDS --decode 16 --out $W/cpu.npz
  python3 -m tools.logits --model $W/tiny --store $W/tinystore --cache-mb 0.3 --device cuda --ids $IDS --decode 16 --out $W/gpu.npz --stats ${VRAM_GB:+--vram-gb $VRAM_GB}
  python3 - <<'PY'
import numpy as np, torch
a, b = np.load("/tmp/w/cpu.npz"), np.load("/tmp/w/gpu.npz")
la, lb = torch.log_softmax(torch.tensor(a["logits"]).double(), -1), torch.log_softmax(torch.tensor(b["logits"]).double(), -1)
kl = float((la.exp() * (la - lb)).sum(-1).mean())
g = int((a["greedy"] == b["greedy"]).cumprod(0).sum())
print(f"GPU streaming (bf16) vs CPU engine (fp32), tiny nvfp4: mean KL {kl:.2e}, greedy agree {g}/{len(a['greedy'])}")
PY
} > "$OUT/check.txt" 2>&1
tail -3 "$OUT/check.txt"
timeout ${E2E_TIMEOUT:-400} python3 -m bench.e2e_stream --work $W/super --moe-layers ${MOE_LAYERS:-4} --io-workers 8 ${E2E_ARGS:-} \
  --out "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.log" | grep -v "^\s*$" | tail -25
