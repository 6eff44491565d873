#!/usr/bin/env bash
# Issue 15 on the main instrument as ONE device call (tools.instrument_downbytes: train, order the BF16 master
# by co-activation, quantize after the order, measure down bytes and exactness, record routing traces).
# Run from the repository root:
#   timeout 470 bash tools/instrument_downbytes_run.sh CORPUS
# CORPUS: train.u16.xz (or train.u16), heldout.u16, heldout.txt, tokenizer/ (tools.instrument_corpus).
# MAIN_SECONDS (training budget, default 230), DEADLINE (seconds for the python part, default 420),
# DOWNBYTES_ARGS (more arguments); a CPU rehearsal:
#   MAIN_PRESET=test DEVICE=cpu MAIN_SECONDS=5 DOWNBYTES_ARGS='--seq-len 128 --batch-tokens 512 --max-steps 3 \
#     --calib-tokens 1024 --heldout-tokens 512 --trace-tokens 600' bash tools/instrument_downbytes_run.sh CORPUS
set -uo pipefail
export PYTHONUNBUFFERED=1
C=$(cd "${1:?usage: instrument_downbytes_run.sh CORPUS}" && pwd)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOG=$OUT/log.txt
PY=${PYTHON:-python3}
{ nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv 2>/dev/null
  $PY -c 'import torch, tokenizers, transformers; print(torch.__version__, tokenizers.__version__, transformers.__version__)'; } >> $LOG 2>&1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t=$(date +%s)
timeout $(( ${DEADLINE:-420} + 10 )) $PY -m tools.instrument_downbytes --data "$C" --out "$OUT" --preset ${MAIN_PRESET:-main} \
  --device ${DEVICE:-cuda} --seconds ${MAIN_SECONDS:-230} --deadline ${DEADLINE:-420} \
  --batch-tokens ${MAIN_BATCH:-32768} ${DOWNBYTES_ARGS:-} >> $LOG 2>&1
echo "== downbytes: rc $? in $(( $(date +%s) - t )) s" | tee -a $LOG
tail -40 $LOG
