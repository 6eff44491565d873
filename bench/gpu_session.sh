#!/usr/bin/env bash
# One device call, several experiments, each under its own time limit; everything lands in $OUT.
#   STEPS="prefill_deep vision check e2e e2e2 e2e_env profile profile_prefill h2d sub8 omni pytest smoke prefill prefill2 api_ttft api_cache turns turnab host subgroups gemv subcheck pieces gemv_pdl stage_extra ahead16k ssd_kernel ssd_prefill gmm gmm_prefill budgets gemv_fma api_long gemv_route e2e_ab timeline eager"
#   (session 35: lend; session 36: fp8fma; session 37: rega_parts; session 41: rega_host; session 42: api_tier;
#   session 45: dense)
#   (default: vision check e2e profile omni),
#   PYTEST_TESTS, PYTEST_X (set empty: no -x), MOE_LAYERS (synthetic super model, default 4),
#   E2E_ARGS (extra bench.e2e_stream flags), E2E_TIMEOUT,
#   E2E_AB_ENV / E2E_AB_ENV_C / E2E_AB_ORDER (e2e_ab: runs named a* default, b* with E2E_AB_ENV, c* with E2E_AB_ENV_C),
#   LEND_ARGS (bench.lend_decode flags), PREFILL_ARGS / PREFILL_TIMEOUT,
#   API_ARGS / API_TIMEOUT (bench.api_ttft: the chat turn through launcher.py).
# Needs carry: [".whl", "build/gpuwheels"] (posix_ipc; fastapi/uvicorn/pydantic for the omni server smoke).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl build/gpuwheels/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site
mount -o remount,size=100G /dev/shm 2>/dev/null || true
{ nvidia-smi --query-gpu=name,memory.total --format=csv; python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'; } > "$OUT/env.txt" 2>&1
STEPS=${STEPS:-vision check e2e profile omni}
W=/tmp/w; mkdir -p $W
T0=$(date +%s); K=0
# A step starts only while fewer than DEADLINE seconds have passed (default: no limit), so a call's last steps are
# skipped, not cut by the device's limit; after each step, loose files are packed (the device returns at most 8).
pack() { local f; f=$(find "$OUT" -maxdepth 1 -type f ! -name 'steps_*.tgz' ! -name env.txt -printf '%f\n')
  [ -z "$f" ] && return; K=$((K+1)); (cd "$OUT" && tar -czf "steps_$K.tgz" $f && rm -f $f); }
# bench.api_ttft with this call's ceilings ($W's copy of bench.prefill's JSON: pack() may have moved $OUT's into an
# archive; without it the API bench measures its own): api_run NAME ARGS... writes $OUT/NAME.{json,log}; API_ENV:
# KEY=VAL ... set for the bench and the server it starts
api_run() { local name=$1; shift; local ceil=(); [ -f $W/prefill.json ] && ceil=(--ceilings-from $W/prefill.json)
  env ${API_ENV:-} timeout ${API_TIMEOUT:-240} python3 -m bench.api_ttft --work $W/super --moe-layers ${MOE_LAYERS:-4} --io-workers 8 \
    ${ceil[@]+"${ceil[@]}"} "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1; tail -6 "$OUT/$name.log"; }
for s in $STEPS; do
  t=$(date +%s)
  if [ $(( t - T0 )) -ge ${DEADLINE:-999999} ]; then echo "== $s: skipped (${DEADLINE} s deadline)"; continue; fi
  case $s in
    prebuild) timeout 150 python3 -c "from bench.workdir import super_store; super_store('$W/super', ${MOE_LAYERS:-4})" > "$OUT/prebuild.log" 2>&1
      tail -2 "$OUT/prebuild.log";;
    vision) timeout 180 python3 -m bench.vision_tower --out "$OUT/vision.json" > "$OUT/vision.log" 2>&1; tail -6 "$OUT/vision.log";;
    check)
      IDS=$(python3 -c 'import random; random.seed(1); print(",".join(str(random.randrange(14, 1000)) for _ in range(30)))')
      { python3 -m tools.synth --preset tiny --quant nvfp4 --out $W/tiny >/dev/null 2>&1
        python3 -m tools.repack --model $W/tiny --out $W/tinystore --no-progress >/dev/null 2>&1
        python3 -m tools.logits --model $W/tiny --ids $IDS --decode 16 --out $W/cpu.npz
        python3 -m tools.logits --model $W/tiny --store $W/tinystore --cache-mb 0.3 --device cuda --ids $IDS --decode 16 --out $W/gpu.npz --stats
        python3 -m tools.logits --model $W/tiny --store $W/tinystore --cache-mb 0.3 --device cuda --ids $IDS --decode 16 --out $W/gpu_vram.npz --stats --vram-gb 20
        python3 -m tools.logits --model $W/tiny --store $W/tinystore --cache-mb 64 --device cuda --ids $IDS --decode 16 --out $W/gpu_ram.npz --stats
        python3 - <<'PY'
import numpy as np, torch
for name in ("gpu", "gpu_vram", "gpu_ram"):
  a, b = np.load("/tmp/w/cpu.npz"), np.load(f"/tmp/w/{name}.npz")
  la, lb = torch.log_softmax(torch.tensor(a["logits"]).double(), -1), torch.log_softmax(torch.tensor(b["logits"]).double(), -1)
  kl = float((la.exp() * (la - lb)).sum(-1).mean())
  g = int((a["greedy"] == b["greedy"]).cumprod(0).sum())
  print(f"GPU streaming (bf16, {name}) vs CPU engine (fp32), tiny nvfp4: mean KL {kl:.2e}, greedy agree {g}/{len(a['greedy'])}")
PY
      } > "$OUT/check.txt" 2>&1; tail -2 "$OUT/check.txt";;
    smoke) timeout 200 python3 tests/server/gpu_smoke.py > "$OUT/smoke.log" 2>&1; tail -8 "$OUT/smoke.log";;
    e2e) timeout ${E2E_TIMEOUT:-300} python3 -m bench.e2e_stream --work $W/super --moe-layers ${MOE_LAYERS:-4} --io-workers 8 ${E2E_ARGS:-} \
           --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1; grep -v "^\s*$" "$OUT/e2e.log" | tail -12;;
    # session 30: a second engine's run in the same call (E2E2_ARGS, e.g. another --io-workers): e2e2.{json,log}
    e2e2) timeout ${E2E_TIMEOUT:-300} python3 -m bench.e2e_stream --work $W/super --moe-layers ${MOE_LAYERS:-4} --io-workers 8 ${E2E2_ARGS:-} \
           --out "$OUT/e2e2.json" > "$OUT/e2e2.log" 2>&1; grep -v "^\s*$" "$OUT/e2e2.log" | tail -12;;
    # session 30: one engine per setting of E2E_ENVS (space-separated KEY=VAL, in that order; a setting may repeat),
    # each with E2E_ARGS: e2e_env_<i>.{json,log}; prints each run's regime rows and the disk's IO-trace line
    e2e_env) i=0; for kv in ${E2E_ENVS:-}; do i=$((i+1))
        env $kv timeout ${E2E_TIMEOUT:-300} python3 -m bench.e2e_stream --work $W/super --moe-layers ${MOE_LAYERS:-4} --io-workers 8 ${E2E_ARGS:-} \
          --out "$OUT/e2e_env_$i.json" > "$OUT/e2e_env_$i.log" 2>&1
        echo "-- $i: $kv"; grep -E "^(disk|ram|vram)[ a-z_,()-]* \| |^disk: io trace|^ceilings" "$OUT/e2e_env_$i.log" | cut -c1-330
      done;;
    prefill) timeout ${PREFILL_TIMEOUT:-330} python3 -m bench.prefill --work $W/super --moe-layers ${MOE_LAYERS:-4} --io-workers 8 \
           ${PREFILL_ARGS:-} --out "$OUT/prefill.json" > "$OUT/prefill.log" 2>&1; cp "$OUT/prefill.json" $W/ 2>/dev/null; tail -22 "$OUT/prefill.log";;
    # session 21: the RAM regime's prompts on a deeper model (DEEP_LAYERS MoE layers, default 8: the issue's own
    # setting; the last layer's kernels after the bus is done are 1/DEEP_LAYERS of the experts' compute), its own work dir
    prefill_deep) timeout ${DEEP_BUILD_TIMEOUT:-150} python3 -c "from bench.workdir import super_store; super_store('$W/super_deep', ${DEEP_LAYERS:-8})" > "$OUT/prefill_deep.log" 2>&1
      tail -1 "$OUT/prefill_deep.log"
      timeout ${PREFILL_DEEP_TIMEOUT:-150} python3 -m bench.prefill --work $W/super_deep --moe-layers ${DEEP_LAYERS:-8} --io-workers 8 \
           ${PREFILL_DEEP_ARGS:-} --out "$OUT/prefill_deep.json" >> "$OUT/prefill_deep.log" 2>&1; tail -${DEEP_TAIL:-16} "$OUT/prefill_deep.log" | cut -c1-200
      # session 23: DEEP_E2E=1 also decodes on it (the issue's own 8 MoE layers: the per-token costs before MoE 0 are an
      # eighth of the floor, not a quarter); E2E_DEEP_ARGS default: the RAM regime only
      if [ "${DEEP_E2E:-0}" = 1 ]; then
        timeout ${E2E_DEEP_TIMEOUT:-120} python3 -m bench.e2e_stream --work $W/super_deep --moe-layers ${DEEP_LAYERS:-8} --io-workers 8 \
          ${E2E_DEEP_ARGS:---skip disk,prefill,vram} --out "$OUT/e2e_deep.json" > "$OUT/e2e_deep.log" 2>&1
        grep -v "^\s*$" "$OUT/e2e_deep.log" | tail -10 | cut -c1-200
      fi
      rm -rf $W/super_deep;;
    prefill2) env ${PREFILL2_ENV:-} timeout ${PREFILL_TIMEOUT:-330} python3 -m bench.prefill --work $W/super --moe-layers ${MOE_LAYERS:-4} \
           --io-workers 8 ${PREFILL2_ARGS:-${PREFILL_ARGS:-}} --out "$OUT/prefill2.json" > "$OUT/prefill2.log" 2>&1; tail -12 "$OUT/prefill2.log";;
    # session 12: the prefill under budgets of BUDGETS MiB (the server's reserve is 512), BUDGET_SIZES tokens, one
    # engine per budget: what a larger reserve buys a long prompt (the VRAM tier gives up as much); BUDGET_ARGS: more
    # bench.prefill flags (session 34: --budget-tier-mb N, a VRAM tier the prompts may borrow their ahead slots from)
    budgets) for b in ${BUDGETS:-512 1024 2048}; do
        timeout ${PREFILL_TIMEOUT:-150} python3 -m bench.prefill --work $W/super --moe-layers ${MOE_LAYERS:-4} --io-workers 8 \
          --skip kernel,sweep,disk --paths staged --sizes 128 --budget-mb $b --budget-sizes ${BUDGET_SIZES:-4000,16000} --budget-env ${BUDGET_ENV:-none} ${BUDGET_PROFILE---profile} \
          ${BUDGET_ARGS:-} \
          --out "$OUT/budget_$b.json" > "$OUT/budget_$b.log" 2>&1; grep -E "^budget [0-9]* MiB|^profile" "$OUT/budget_$b.log" | cut -c1-220
        # session 16: each budget row with its env (an A/B in one engine: BUDGET_ENV="none,KEY=VAL,...")
        grep "^budget {" "$OUT/budget_$b.log" | python3 -c "import sys, json
for r in (json.loads(l[7:]) for l in sys.stdin):
    print(r.get('env') or 'default', r.get('tokens'), 'TTFT ms', round(r.get('ttft_s', 0) * 1e3, 1), 'launches', r.get('launches'),
          'host launching ms', round(r.get('ms_host_launching', 0), 1), 'router sync ms', round(r.get('ms_router_sync', 0), 1), 'first', r.get('first_token'))"
      done;;
    api_ttft) api_run api_ttft ${API_ARGS:-};;
    # session 13: long prompts through the server with a --vram-gb budget (the prefill reserve of
    # gpu_worker/vram_tier.prefill_reserve_bytes applies), one server per size: API_SIZES tokens, API_LONG_ARGS
    # API_LONG_SETS: server argument sets separated by ';' (default "--vram-gb 8"; "none": no extra argument)
    api_long) IFS=';' read -ra sets <<< "${API_LONG_SETS:---vram-gb 8}"; i=0
      for set in "${sets[@]}"; do i=$((i+1)); [ "$set" = none ] && set=""
        for n in ${API_SIZES:-4000 16000}; do echo "set $i: '$set', $n tokens"; api_run api_long_${n}_$i --regimes ram --tokens $n --repeats 3 $set; done; done;;
    # session 42: the chat turn beside a VRAM tier that decode warmed (each warm-up turn decodes API_WARM_DECODE
    # tokens), the tier's residents read in place (MOESTREAM_PREFILL_TIER=1) against ignored (0), one server per arm
    api_tier) for arm in 1 0; do echo "MOESTREAM_PREFILL_TIER=$arm"
        API_ENV="MOESTREAM_PREFILL_TIER=$arm ${API_ENV:-}" \
        api_run api_tier_$arm --regimes ${API_TIER_REGIMES:-ram,disk} --vram-gb ${API_TIER_GB:-8} \
        --warm-decode ${API_WARM_DECODE:-256} ${API_ARGS:-}; done;;
    api_cache) api_run api_ttft_cache --regimes ram --cache-prompt on ${API_CACHE_ARGS:-};;   # the server's default
    turns) timeout ${TURNS_TIMEOUT:-100} python3 -m bench.prefill_turns --work $W/super --moe-layers ${MOE_LAYERS:-4} --profile \
           ${TURNS_ARGS:-} --out "$OUT/prefill_turns.json" > "$OUT/prefill_turns.log" 2>&1; tail -40 "$OUT/prefill_turns.log" | cut -c1-160
      timeout ${TURNS_TIMEOUT:-100} python3 -m bench.prefill_turns --work $W/super --moe-layers ${MOE_LAYERS:-4} --capture 5 \
           ${TURNS_ARGS:-} --out "$OUT/prefill_turns_capture.json" > "$OUT/prefill_turns_capture.log" 2>&1; tail -12 "$OUT/prefill_turns_capture.log";;
    # the cache_prompt turn's A/B in one process, interleaved (bench.prefill_turns --modes)
    turnab) timeout ${TURNS_TIMEOUT:-150} python3 -m bench.prefill_turns --work $W/super --moe-layers ${MOE_LAYERS:-4} --profile \
           --modes ${TURN_MODES:-off,drop,cut,keep} --rounds ${TURN_ROUNDS:-3} ${TURNS_ARGS:-} \
           --out "$OUT/prefill_turns_ab.json" > "$OUT/prefill_turns_ab.log" 2>&1; tail -8 "$OUT/prefill_turns_ab.log";;
    # where a short prompt's prefill spends the device's time (RAM regime): PROFILE_PREFILL sizes, default 128,1000;
    # PROFILE_ARGS more bench.profile_kernels flags (session 42: --tier-mb 2048)
    profile_prefill) timeout ${PROFILE_TIMEOUT:-90} python3 -m bench.profile_kernels --work $W/super --moe-layers ${MOE_LAYERS:-4} --decode "" \
           --prefill ${PROFILE_PREFILL:-128,1000} ${PROFILE_ARGS:-} --top 30 --out "$OUT/profile_prefill.json" \
           > "$OUT/profile_prefill.log" 2>&1
      grep -E "^== |^copies|^other|^gemm|^elementwise|^expert|^sort|^mamba|^attention|^router|^gemv" "$OUT/profile_prefill.log" | cut -c1-160;;
    # session 16: where the prefill's host time goes, py-spy's samples (carried in .whl/py-spy) of bench.prefill RAM
    # prompts of SPY_SIZES tokens, summarized under the MoE step (`_prefill`) and the model's forward. Session 25: at
    # 1 kHz on a slow host py-spy fell 20 s behind and the step's timeout killed it before it wrote anything, so
    # 400 Hz by default, and py-spy's own --duration ends the sampling (and writes) before the step's timeout.
    # Session 42: SPY_ARGS more bench.prefill flags (e.g. --tier-mb 2048), SPY_UNDER the functions summarized under
    spy) timeout ${SPY_TIMEOUT:-150} .whl/py-spy record -r ${SPY_RATE:-400} -d $(( ${SPY_TIMEOUT:-150} - 15 )) -f raw \
           -o "$OUT/spy.txt" -- python3 -m bench.prefill \
           --work $W/super --moe-layers ${MOE_LAYERS:-4} --io-workers 8 --skip kernel,sweep,disk --sizes ${SPY_SIZES:-16000} \
           --paths ${SPY_PATHS:-staged,staged#2,staged#3} --budget-mb 0 --brief ${SPY_ARGS:-} \
           --out "$OUT/prefill_spy.json" > "$OUT/spy.log" 2>&1
      tail -4 "$OUT/spy.log" | cut -c1-200
      for u in ${SPY_UNDER:-_prefill forward}; do
        python3 -m bench.host_samples "$OUT/spy.txt" --under $u --top ${SPY_TOP:-22} > "$OUT/spy_$u.txt" 2>&1; done
      cat "$OUT/spy_$(echo ${SPY_UNDER:-_prefill} | cut -d' ' -f1).txt" | cut -c1-150;;
    # session 16: the grouped expert prefill's kernel variants and pieces (down GEMM relaxed / acq_rel atomics)
    # session 45: the dense NVFP4 projections at prefill size (bench/kernels/dense_prefill.py; DENSE_ARGS its flags,
    # e.g. --piece 1024 --slices 4,8 --kernel-configs "BLOCK_M=128,BLOCK_N=128"): the tile kernel against decode + cuBLAS
    dense) timeout ${DENSE_TIMEOUT:-200} python3 -m bench.kernels.dense_prefill ${DENSE_ARGS:-} --out "$OUT/dense_prefill.json" \
           > "$OUT/dense_prefill.log" 2>&1; grep -E "^\||checks ok|decode|FAILED|ERROR" "$OUT/dense_prefill.log" | cut -c1-260;;
    sweep) timeout ${SWEEP_TIMEOUT:-150} python3 -m bench.kernels.expert_prefill_sweep ${SWEEP_ARGS:-} --out "$OUT/sweep.json" \
           > "$OUT/sweep.log" 2>&1; grep -v "^\s*$" "$OUT/sweep.log" | tail -${SWEEP_TAIL:-30} | cut -c1-220;;
    # session 14: the prefill's device timeline, copy engine beside compute, per MoE layer (bench.prefill_timeline)
    timeline) timeout ${TIMELINE_TIMEOUT:-150} python3 -m bench.prefill_timeline --work $W/super --moe-layers ${MOE_LAYERS:-4} \
           --sizes ${TIMELINE_SIZES:-1000,4000,16000} --env ${TIMELINE_ENV:-none} ${TIMELINE_ARGS:-} --out "$OUT/prefill_timeline.json" > "$OUT/prefill_timeline.log" 2>&1
      grep -v "^\s*$" "$OUT/prefill_timeline.log" | grep -v Warning | tail -${TIMELINE_TAIL:-40} | cut -c1-200;;
    # session 14: the copies ahead in runs of 8 against unbounded runs, with the gate at 0, and eager copies
    # (MOESTREAM_PREFILL_EAGER): an A/B in one engine, RAM, two rounds
    eager) timeout 70 python3 -m pytest -q -x -p no:cacheprovider tests/gpu_worker/test_prefill_ahead.py -k "gpu" > "$OUT/pytest_eager.log" 2>&1; tail -2 "$OUT/pytest_eager.log"
      timeout ${PREFILL_TIMEOUT:-200} python3 -m bench.prefill --work $W/super --moe-layers ${MOE_LAYERS:-4} --io-workers 8 \
           --skip kernel,sweep,disk --sizes ${EAGER_SIZES:-128,1000,4000,16000} --budget-mb 0 --brief \
           --paths ${EAGER_PATHS:-staged|MOESTREAM_AHEAD_RUN_MAX=0,staged,staged~0,staged~0|MOESTREAM_PREFILL_EAGER=1,staged|MOESTREAM_AHEAD_RUN_MAX=0#2,staged#2,staged~0#2,staged~0|MOESTREAM_PREFILL_EAGER=1#2} \
           --out "$OUT/prefill_eager.json" > "$OUT/prefill_eager.log" 2>&1; cp "$OUT/prefill_eager.json" $W/prefill.json 2>/dev/null
      grep -v "^\s*$" "$OUT/prefill_eager.log" | tail -${EAGER_TAIL:-30} | cut -c1-220;;
    # issue 15: the same model on a store of down sub-groups of SUB_N (default 8): prefill (never measured there) and
    # the RAM regime's decode, beside the default store's rows of this call
    sub8) mkdir -p $W/super8; ln -sfn $W/super/model $W/super8/model
      timeout 150 python3 -m tools.repack --model $W/super/model --out $W/super8/store --down-group-neurons ${SUB_N:-8} \
        --no-progress > "$OUT/sub8.log" 2>&1
      timeout 120 python3 -m bench.prefill --work $W/super8 --moe-layers ${MOE_LAYERS:-4} --io-workers 8 --skip kernel,sweep,disk \
        --sizes 128,1000,4000,16000 --paths staged,staged#2 --budget-mb 0 --brief --out "$OUT/prefill_sub8.json" >> "$OUT/sub8.log" 2>&1
      timeout 120 python3 -m bench.e2e_stream --work $W/super8 --moe-layers ${MOE_LAYERS:-4} --io-workers 8 \
        --skip disk,prefill,vram,ram_nostage --out "$OUT/e2e_sub8.json" >> "$OUT/sub8.log" 2>&1
      grep -E "^ram staged|^RAM|^regime" "$OUT/sub8.log" | cut -c1-150;;
    # session 18: the SMs' reads of registered host memory (plain loads, TMA) beside the copy engine
    pinned) timeout ${PINNED_TIMEOUT:-120} python3 -m bench.kernels.pinned_read --out "$OUT/pinned_read.json" > "$OUT/pinned_read.log" 2>&1
      tail -16 "$OUT/pinned_read.log";;
    # session 18: a Triton launch's host cost through the JIT and straight to the compiled kernel
    launch) timeout 60 python3 -m bench.kernels.launch_overhead --out "$OUT/launch_overhead.json" > "$OUT/launch_overhead.log" 2>&1
      tail -6 "$OUT/launch_overhead.log";;
    # session 18: a decode token on the device's timeline, the bus's readers against the dense kernels
    dtimeline) env ${DTIMELINE_ENV:-} timeout ${DTIMELINE_TIMEOUT:-150} python3 -m bench.decode_timeline --work $W/super --moe-layers ${MOE_LAYERS:-4} \
           ${DTIMELINE_ARGS:-} --out "$OUT/decode_timeline.json" > "$OUT/decode_timeline.log" 2>&1; grep -v Warning "$OUT/decode_timeline.log" | tail -22;;
    h2d) timeout 90 python3 -m bench.h2d_blocks --out "$OUT/h2d_blocks.json" > "$OUT/h2d_blocks.log" 2>&1; tail -7 "$OUT/h2d_blocks.log";;
    profile) timeout 150 python3 -m bench.profile_decode --work $W/super --moe-layers ${MOE_LAYERS:-4} --out "$OUT/profile.json" > "$OUT/profile.log" 2>&1; head -30 "$OUT/profile.log";;
    pytest) timeout ${PYTEST_TIMEOUT:-200} python3 -m pytest -q ${PYTEST_X--x} -p no:cacheprovider \
              ${PYTEST_TESTS:-tests/gpu_worker/test_decode_graphs.py tests/gpu_worker/test_weight_stream.py \
              tests/nemotron/test_fused_decode.py tests/kernels tests/gpu_worker/test_prefill.py::test_gpu_layer_major_both_weight_paths} > "$OUT/pytest.log" 2>&1; tail -3 "$OUT/pytest.log";;
    # session 19: the SM staging of slab-routed layers' ups against the copy engine, alone and beside a dense read
    stageb) timeout ${STAGEB_TIMEOUT:-90} python3 -m bench.kernels.stage_ups --out "$OUT/stage_ups.json" > "$OUT/stage_ups.log" 2>&1
      tail -12 "$OUT/stage_ups.log";;
    # after `pytest`: a failed GPU test skips every later step (their figures would be of broken code)
    gate) if grep -q -E "^(FAILED|ERROR)|[0-9] (failed|errors?)\b" "$OUT/pytest.log" 2>/dev/null; then
            echo "== gate: the GPU tests failed, every later step skipped"; T0=0; fi;;
    host) timeout 150 python3 -m bench.host_bookkeeping --tag h200 --out-dir "$OUT" > "$OUT/host.log" 2>&1; tail -8 "$OUT/host.log";;
    gemv) timeout ${GEMV_TIMEOUT:-150} python3 -m bench.kernels.gemv_nvfp4_sweep --budget-s $(( ${GEMV_TIMEOUT:-150} - 25 )) \
           --out "$OUT/gemv_sweep.json" > "$OUT/gemv_sweep.log" 2>&1; tail -40 "$OUT/gemv_sweep.log";;
    # session 12 h-gemv: the NVFP4 decode GEMV on the CUDA cores (HFMA2) and its read probe beside today's
    gemv_fma) timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_gemv_nvfp4_fma.py > "$OUT/pytest_gemv_fma.log" 2>&1
      tail -2 "$OUT/pytest_gemv_fma.log"
      timeout 150 python3 -m bench.kernels.gemv_fma_sweep --budget-s 125 --out "$OUT/gemv_fma.json" > "$OUT/gemv_fma.log" 2>&1
      tail -60 "$OUT/gemv_fma.log";;
    # session 37: the expert prefill decoded into wgmma's register operand: each launch alone, with and without
    # the decode (REGA_DEPTHS: the configs, e.g. 1,6,5t,v2; REGA_PROBES: 0,2,1,3; REGA_LI: another L,I)
    # session 41: the host's time a grouped launch by path, and the rega path's pieces
    rega_host) timeout 150 python3 -m bench.kernels.rega_host --out "$OUT/rega_host.json" > "$OUT/rega_host.log" 2>&1
      tail -20 "$OUT/rega_host.log";;
    rega_parts) timeout ${REGA_TIMEOUT:-150} python3 -m bench.kernels.expert_prefill_rega_gluon \
        > "$OUT/rega_parts.log" 2>&1
      tail -${REGA_TAIL:-8} "$OUT/rega_parts.log";;
    # session 36: the FP8 GEMV on the CUDA cores (bench/kernels/gemv_fp8_fma.py): its tests with the PTX, then the sweep
    fp8fma) timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_gemv_fp8_fma.py \
        tests/kernels/test_gemv_bf16.py tests/kernels/test_gemv_nvfp4_fma.py > "$OUT/pytest_fp8fma.log" 2>&1
      tail -2 "$OUT/pytest_fp8fma.log"; FT=${FP8FMA_TIMEOUT:-200}
      timeout $FT python3 -m bench.kernels.gemv_fma_sweep --fp8 --budget-s $(( FT - 30 )) \
        --out "$OUT/fp8fma.json" > "$OUT/fp8fma.log" 2>&1
      grep -E "^read|BAD|FAILED|WRONG|raised" "$OUT/fp8fma.log" | head -8; tail -16 "$OUT/fp8fma.log"
      timeout 100 python3 -m bench.kernels.gemv_fma_sweep --bf16 --budget-s 80 --out "$OUT/bf16gemv.json" \
        > "$OUT/bf16gemv.log" 2>&1
      grep -E "^read|BAD|FAILED|WRONG" "$OUT/bf16gemv.log" | head -4; tail -12 "$OUT/bf16gemv.log";;
    # session 13 h-fmaroute: the FMA GEMV routed at M = 1 through GEMV_CHOICES' 'FMA' key: its tests on the GPU (the
    # route captured in a CUDA graph and replayed included), then the FMA sweep against the read ceiling
    # (bench.kernels.common.ceiling_read; today = the tensor cores, routed = nvfp4_linear as the engine calls it)
    gemv_route) timeout 90 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_gemv_nvfp4_fma.py \
           tests/bench/test_ceiling_read.py > "$OUT/pytest_gemv_route.log" 2>&1; tail -2 "$OUT/pytest_gemv_route.log"
      timeout 170 python3 -m bench.kernels.gemv_fma_sweep --budget-s 140 --out "$OUT/gemv_route.json" > "$OUT/gemv_route.log" 2>&1
      grep -E "^read|BAD|FAILED|WRONG" "$OUT/gemv_route.log" | head -8; tail -44 "$OUT/gemv_route.log";;
    # session 13: the RAM regime's decode A/B in one call, alternated (A B A B): E2E_AB_ENV="KEY=VALUE" is B
    # runs named a* take the defaults, b* E2E_AB_ENV, c* E2E_AB_ENV_C (a third arm, session 27)
    e2e_ab) for r in ${E2E_AB_ORDER:-a b a2 b2}; do [ $(( $(date +%s) - T0 )) -ge ${DEADLINE:-999999} ] && break
           case ${r:0:1} in b) ENVS=${E2E_AB_ENV:-MOESTREAM_GEMV_FMA=0};; c) ENVS=${E2E_AB_ENV_C:?};; *) ENVS=;; esac
           env $ENVS timeout ${E2E_TIMEOUT:-90} python3 -m bench.e2e_stream --work $W/super --moe-layers ${MOE_LAYERS:-4} --io-workers 8 \
             --skip disk,prefill,vram ${E2E_ARGS:-} --out "$OUT/e2e_$r.json" > "$OUT/e2e_$r.log" 2>&1
           echo "$r ${ENVS:-default}: $(grep -E '^RAM \|' "$OUT/e2e_$r.log")"; done;;
    subcheck) timeout 120 python3 -m bench.kernels.subgroup_check > "$OUT/subgroup_check.log" 2>&1; tail -12 "$OUT/subgroup_check.log";;
    omni) timeout 200 python3 tests/server/gpu_omni_smoke.py > "$OUT/omni.log" 2>&1; tail -4 "$OUT/omni.log";;
    # session 7's switches, each off by default until one of these runs measures it (bench/NOTES.md, h26-h28):
    pieces) timeout 25 python3 -m pytest -q -x -p no:cacheprovider tests/gpu_worker/test_staging_runs.py tests/kernels/test_mamba_carry.py > "$OUT/pytest_pieces.log" 2>&1; tail -2 "$OUT/pytest_pieces.log"
      timeout 95 python3 -m bench.prefill --work $W/super --moe-layers ${MOE_LAYERS:-4} --io-workers 8 --skip kernel,sweep,disk --sizes 1000,4000,16000 \
        --paths "staged_no_ahead,staged_no_ahead@4096,staged_no_ahead@4096+,staged_no_ahead#2,staged_no_ahead@4096+#2" --budget-mb 512 --budget-pieces 0,4096 \
        --brief --out "$OUT/prefill_pieces.json" > "$OUT/prefill_pieces.log" 2>&1; tail -24 "$OUT/prefill_pieces.log" | cut -c1-220
      MOESTREAM_PIECE_TOKENS=4096 MOESTREAM_MAMBA_CARRY_KERNEL=1 MOESTREAM_COPY_RUNS=1 timeout 50 python3 -m bench.profile_kernels --work $W/super \
        --moe-layers ${MOE_LAYERS:-4} --decode "" --prefill 16000 --top 24 --out "$OUT/profile_kernels_pieces.json" > "$OUT/profile_kernels_pieces.log" 2>&1
      head -14 "$OUT/profile_kernels_pieces.log";;
    gemv_pdl) timeout 92 python3 -m bench.kernels.gemv_pdl_sweep --budget-s 76 --out "$OUT/gemv_pdl.json" > "$OUT/gemv_pdl.log" 2>&1
      timeout 22 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_gemv_stream_k.py -k "stream_k_matches_twin or pdl" > "$OUT/pytest_stream_k.log" 2>&1
      tail -3 "$OUT/pytest_stream_k.log"; tail -70 "$OUT/gemv_pdl.log";;
    stage_extra) timeout 15 python3 -m pytest -q -x -p no:cacheprovider tests/gpu_worker/test_up_dma.py > "$OUT/pytest_up_dma.log" 2>&1; tail -2 "$OUT/pytest_up_dma.log"
      timeout 100 python3 -m bench.e2e_stream --work $W/super --moe-layers ${MOE_LAYERS:-4} --io-workers 8 --skip disk,prefill,vram,ram_nostage \
        --stage-extra 3,6 --up-dma 8 --out "$OUT/e2e_stage_extra.json" > "$OUT/e2e_stage_extra.log" 2>&1
      grep -v "^\s*$" "$OUT/e2e_stage_extra.log" | grep -v "device memory" | tail -16;;
    # the copies ahead (off by default): the copy-order fix's GPU test, then the 16k prompt that gave a wrong first token
    ahead16k) timeout 40 python3 -m pytest -q -x -p no:cacheprovider tests/gpu_worker/test_copy_buffers_order.py > "$OUT/pytest_copy_order.log" 2>&1; tail -2 "$OUT/pytest_copy_order.log"
      timeout 90 python3 -m bench.prefill --work $W/super --moe-layers ${MOE_LAYERS:-4} --io-workers 8 --skip kernel,sweep,disk --sizes 4000,16000 \
        --paths staged_no_ahead,staged --budget-mb 0 --brief --out "$OUT/prefill_ahead16k.json" > "$OUT/prefill_ahead16k.log" 2>&1; tail -8 "$OUT/prefill_ahead16k.log";;
    # h-scan (session 11): the Mamba scan on the tensor cores (kernels/mamba_ssd.py, MOESTREAM_MAMBA_SSD, off by default).
    # ssd_kernel needs no store: the kernel tests on CUDA, then old vs new per layer at 4k / 16k in one process
    ssd_kernel) timeout 65 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_mamba_ssd.py \
           tests/nemotron/test_mamba_mixer.py::test_ssd_kernels_equal_the_twin_in_the_model > "$OUT/pytest_ssd.log" 2>&1; tail -2 "$OUT/pytest_ssd.log"
      timeout 85 python3 -m bench.kernels.mamba_ssd --sizes 4000,16000 --variants ${SSD_VARIANTS:-ssd,i128_j64_w8,i64_j64,state_n64,nosplit} \
           --out "$OUT/mamba_ssd.json" > "$OUT/mamba_ssd.log" 2>&1; tail -3 "$OUT/mamba_ssd.log" | cut -c1-400;;
    # the prompt's TTFT with the switch off and on, interleaved twice in one engine (after prebuild)
    ssd_prefill) timeout ${PREFILL_TIMEOUT:-90} python3 -m bench.prefill --work $W/super --moe-layers ${MOE_LAYERS:-4} --io-workers 8 \
           --skip kernel,sweep,disk --sizes ${SSD_SIZES:-4000,16000} --budget-mb 0 --brief --out "$OUT/prefill_ssd.json" \
           --paths "staged|MOESTREAM_MAMBA_SSD=0,staged,staged|MOESTREAM_MAMBA_SSD=0#2,staged#2" > "$OUT/prefill_ssd.log" 2>&1
      tail -10 "$OUT/prefill_ssd.log" | cut -c1-200;;
    # session 12 h-gmm: the dequantized expert path's GEMMs by torch._grouped_mm (CUTLASS) against Triton's: GPU tests,
    # the kernel bench (one process, <= 120 s), then the prompt's TTFT with MOESTREAM_EXPERT_GEMM per path, interleaved
    gmm) timeout 90 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_expert_prefill_gmm.py \
           tests/kernels/test_expert_prefill_dequant.py > "$OUT/pytest_gmm.log" 2>&1; tail -2 "$OUT/pytest_gmm.log"
      MOESTREAM_EXPERT_GEMM=grouped_mm timeout 120 python3 -m pytest -q -x -p no:cacheprovider \
           "tests/gpu_worker/test_prefill.py::test_gpu_layer_major_both_weight_paths" -s >> "$OUT/pytest_gmm.log" 2>&1
      grep -E "mean KL|passed|failed" "$OUT/pytest_gmm.log" | tail -4
      timeout 130 python3 -m bench.kernels.expert_prefill_gmm ${GMM_ARGS:-} --out "$OUT/expert_prefill_gmm.json" \
           > "$OUT/expert_prefill_gmm.log" 2>&1; tail -24 "$OUT/expert_prefill_gmm.log" | cut -c1-200;;
    gmm_prefill) timeout ${PREFILL_TIMEOUT:-150} python3 -m bench.prefill --work $W/super --moe-layers ${MOE_LAYERS:-4} --io-workers 8 \
           --skip kernel,sweep,disk --sizes ${GMM_SIZES:-1000,4000,16000} --budget-mb 0 --brief --out "$OUT/prefill_gmm.json" \
           --paths "${GMM_PATHS:-staged,staged|MOESTREAM_EXPERT_GEMM=grouped_mm,staged|MOESTREAM_EXPERT_GEMM=grouped_mm_down,staged#2,staged|MOESTREAM_EXPERT_GEMM=grouped_mm#2,staged|MOESTREAM_EXPERT_GEMM=grouped_mm_down#2}" \
           > "$OUT/prefill_gmm.log" 2>&1; tail -14 "$OUT/prefill_gmm.log" | cut -c1-200;;
    subgroups) timeout ${SUB_TIMEOUT:-240} python3 -m bench.e2e_stream --work $W/super-sub --moe-layers ${SUB_MOE_LAYERS:-2} --io-workers 8 \
           --down-group-neurons ${SUB_SIZES:-16,8,4} --synth-args "${SUB_SYNTH_ARGS:---sparsity 0.95 --routing-skew 0.3 --neuron-coherence 0.45}" \
           --skip prefill --out "$OUT/subgroups.json" > "$OUT/subgroups.log" 2>&1; tail -8 "$OUT/subgroups.log";;
    # session 35: the decode after a long prompt that borrowed the VRAM tier's slots, by arm (bench.lend_decode)
    lend) timeout ${LEND_TIMEOUT:-300} python3 -m bench.lend_decode --work $W/super --moe-layers ${MOE_LAYERS:-4} \
           ${LEND_ARGS:-} --out "$OUT/lend_decode.json" > "$OUT/lend_decode.log" 2>&1
      grep -v Warning "$OUT/lend_decode.log" | tail -16 | cut -c1-240;;
  esac
  echo "== $s: rc $? in $(( $(date +%s) - t )) s"
  [ "$(find "$OUT" -type f | wc -l)" -gt 6 ] && pack
done
# the device returns at most 8 files from $OUT (session 6 lost a call's files to that): more than 8, one archive
n=$(find "$OUT" -type f | wc -l)
if [ "$n" -gt 8 ]; then
  tar -C "$OUT" -czf /tmp/gpu_session_out.tgz . && find "$OUT" -mindepth 1 -delete && mv /tmp/gpu_session_out.tgz "$OUT/gpu_session_out.tgz"
  echo "== $n files packed into gpu_session_out.tgz (the device returns at most 8)"
fi
