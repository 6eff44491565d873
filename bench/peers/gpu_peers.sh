#!/usr/bin/env bash
# One device call: llama.cpp (built here from the source tree) beside moestream on one synthetic checkpoint,
# bench/peers/compare.py; everything lands in $OUT (6 files: env.txt, peers.log, peers.json, peers.png,
# compare.log, moestream.log).
# Run from this worktree's root inside the main checkout (`cd .wt/h16-peers`); TOP is the checkout's root, which
# holds the carried .peers/lcpp, .whl and build/gpuwheels. MOE_LAYERS (default 2), BUDGET (seconds the harness
# plans for, default 515), KILL (hard stop, default 550) and COMPARE_ARGS (more flags) can be set.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TOP=${TOP:-../..}
W=${W:-/tmp/pw}; mkdir -p "$W"
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$TOP"/.whl/*.whl "$TOP"/build/gpuwheels/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site
command -v nvidia-smi >/dev/null && { mount -o remount,size=100G /dev/shm 2>/dev/null || true; }
{ nvidia-smi --query-gpu=name,memory.total,memory.free --format=csv
  nproc; free -g; df -h /tmp /dev/shm
  echo "nvcc: $(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>&1)"; nvcc --version 2>&1 | tail -2
  cmake --version | head -1; ninja --version
  python3 -c 'import torch, transformers, safetensors, sentencepiece, numpy, yaml; print("torch", torch.__version__, "transformers", transformers.__version__, "numpy", numpy.__version__)'
  PYTHONPATH="$TOP/.peers/lcpp/gguf-py:${PYTHONPATH:-}" python3 -c 'import gguf; print("gguf-py from", gguf.__file__)'
  echo "cgroup: $(cat /sys/fs/cgroup/cgroup.controllers 2>&1) | subtree: $(cat /sys/fs/cgroup/cgroup.subtree_control 2>&1)"
  echo "drop_caches writable: $(test -w /proc/sys/vm/drop_caches && echo yes || echo no)"
  echo "/proc/self/io: $(grep read_bytes /proc/self/io 2>&1)"
  python3 -c 'import nvidia, glob; [print("pip cuBLAS:", p) for b in nvidia.__path__ for p in glob.glob(b + "/**/libcublas.so*", recursive=True)]' 2>&1 | head -3
  ls /usr/local/cuda/include/cublas_v2.h /usr/local/cuda/targets/*/include/cublas_v2.h 2>&1 | head -2
} > "$OUT/env.txt" 2>&1
echo "== setup $(( $(date +%s) - t0 )) s"; cat "$OUT/env.txt"
timeout -k 15 "${KILL:-550}" python3 -m bench.peers.compare --llama-src "$TOP/.peers/lcpp" --work "$W" \
  --moe-layers "${MOE_LAYERS:-2}" --device cuda --budget-s "${BUDGET:-515}" \
  --out "$OUT/peers.json" --plot "$OUT/peers.png" ${COMPARE_ARGS:-} 2>&1 | tee "$OUT/peers.log"
echo "== compare rc ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"
tail -c 4000000 "$W/compare.log" > "$OUT/compare.log" 2>/dev/null
for f in "$W"/moestream-*.log; do [ -f "$f" ] && { echo "=== $f"; tail -c 200000 "$f"; }; done > "$OUT/moestream.log"
# a launcher runs in its own session, so a harness stopped by `timeout` leaves it behind: end those it started
for f in "$W"/pids/*; do
  [ -f "$f" ] || continue; pg=$(basename "$f")
  kill -TERM -- "-$pg" 2>/dev/null; sleep 5; kill -KILL -- "-$pg" 2>/dev/null; rm -f "$f"
  echo "ended the launcher session $pg left running"; rm -f /dev/shm/moestream-*
done
ls /dev/shm | grep -c moestream- | sed 's/^/shared-memory objects left: /'
