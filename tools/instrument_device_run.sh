#!/usr/bin/env bash
# The instrument's one device call: train the main model and the tiny test model, write both in the hub
# layout (BF16 + NVFP4), measure the statistics on held-out chat-like text, and run the main model's
# NVFP4 checkpoint through tools.repack, the store and the engine. Every step has its own time limit;
# what matters most comes first. Run from a folder holding code/ (this repository) and corpus/
# (tools.instrument_corpus output: train.u16.xz, heldout.u16, heldout.txt, tokenizer/) and whl/ (posix_ipc).
#   MAIN_SECONDS (default 360), MAIN_BATCH (tokens, default 32768), TINY_SECONDS (default 45), SKIP_TINY=1; for a rehearsal on a CPU: MAIN_PRESET=test DEVICE=cpu
#   TRAIN_ARGS='--seq-len 128 --batch-tokens 512 --max-steps 2'
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
HERE=$(pwd)
C=$HERE/corpus
W=/tmp/instrument; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site
export PYTHONPATH=$HERE/code:${PYTHONPATH:-}
[ "${DEVICE:-cuda}" = cuda ] && mount -o remount,size=32G /dev/shm 2>/dev/null
cd code
LOG=$OUT/log.txt
step() { echo "== $1: rc $2 in $(( $(date +%s) - $3 )) s at $(date +%T)" | tee -a $LOG; }
{ nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv
  python3 -c 'import torch, triton, tokenizers, transformers; print(torch.__version__, triton.__version__, tokenizers.__version__, transformers.__version__)'; } >> $LOG 2>&1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
t=$(date +%s)
timeout 430 python3 -m tools.train_instrument --data $C --preset ${MAIN_PRESET:-main} --seconds ${MAIN_SECONDS:-360} \
  --batch-tokens ${MAIN_BATCH:-32768} ${TRAIN_ARGS:-} --out $W/main --log $OUT/main_loss.jsonl >> $LOG 2>&1
rc=$?
if [ ! -f $W/main/nvfp4/config.json ] && [ $(( $(date +%s) - t )) -lt 120 ]; then   # e.g. out of memory: half the batch
  left=$(( ${MAIN_SECONDS:-360} - ($(date +%s) - t) - 20 ))
  echo "== main failed (rc $rc), again with half the batch for $left s" | tee -a $LOG
  timeout 430 python3 -m tools.train_instrument --data $C --preset ${MAIN_PRESET:-main} --seconds $left \
    --batch-tokens $(( ${MAIN_BATCH:-32768} / 2 )) ${TRAIN_ARGS:-} --out $W/main --log $OUT/main_loss.jsonl >> $LOG 2>&1
  rc=$?
fi
step main $rc $t
if [ -z "${SKIP_TINY:-}" ]; then
  t=$(date +%s)
  timeout 110 python3 -m tools.train_instrument --data $C --preset tiny --seconds ${TINY_SECONDS:-45} --lr 3e-3 ${TRAIN_ARGS:-} --eval-every 100 \
    --out $W/tiny --log $W/tiny/loss.jsonl --quant nvfp4 bf16 >> $LOG 2>&1 || mkdir -p $W/tiny
  step tiny $? $t
  tar -C $W/tiny -cJf $OUT/instrument-tiny.tar.xz . 2>>$LOG
fi
t=$(date +%s)
timeout 100 python3 -m tools.instrument_stats --model $W/main/nvfp4 --name instrument --text-file $C/heldout.txt \
  --tokens 2048 --device ${DEVICE:-cuda} --max-seconds 40 --out $OUT/stats.json --record-routing $OUT/routing-instrument.msgpack >> $LOG 2>&1
step stats $? $t
t=$(date +%s)
head -c 16000 $C/heldout.txt > $W/heldout-small.txt
{ timeout 40 python3 -m tools.repack --model $W/main/nvfp4 --out $W/store --no-progress
  for d in nvfp4 bf16; do echo "ppl $d in memory:"; timeout 30 python3 -m tools.ppl --model $W/main/$d --text-file $W/heldout-small.txt --device ${DEVICE:-cuda} | tail -1; done
  echo "ppl nvfp4 through the store, cache 22 MiB (~10 %):"
  timeout 40 python3 -m tools.ppl --model $W/main/nvfp4 --text-file $W/heldout-small.txt --store $W/store --cache-mb 22 --device ${DEVICE:-cuda} | tail -1
} >> $LOG 2>&1
step ppl $? $t
tar -C $W/main -cJf $OUT/instrument-main-meta.tar.xz summary.json nvfp4/config.json nvfp4/hf_quant_config.json \
  nvfp4/model.safetensors.index.json bf16/config.json 2>>$LOG
du -sh $W/main/* >> $LOG 2>&1
tail -5 $LOG
