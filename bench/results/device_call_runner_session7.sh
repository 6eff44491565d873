#!/usr/bin/env bash
# Integrator's shared device call: runs each named helper's one-line GPU command (.wt/_brief/s7/<h>.gpu copied
# here as <h>.gpu) on a copy of main with <h>.patch (git diff main..<h>) applied, each under HT seconds (default 175).
# Usage: HT=175 bash .wt/_call/run.sh h26-pieces h27-gemv
set -u
export PYTHONUNBUFFERED=1
ROOT=$(pwd); C=$ROOT/.wt/_call
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl build/gpuwheels/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
mount -o remount,size=100G /dev/shm 2>/dev/null || true
if [ -n "${PREBUILD:-}" ]; then   # the synthetic super store every helper's command reuses, outside their timers
  t=$(date +%s); (cd "$ROOT" && timeout 120 python3 -c "from bench.workdir import super_store; super_store('/tmp/w/super', 4)") > "$OUT/prebuild.log" 2>&1
  echo "== prebuild: rc $? in $(( $(date +%s) - t )) s"; tail -3 "$OUT/prebuild.log"
fi
for h in "$@"; do
  t=$(date +%s)
  D=/tmp/tree-$h; rm -rf "$D"; mkdir -p "$D"
  tar -C "$ROOT" --exclude=./.wt/h2* -cf - . | tar -C "$D" -xf -
  (cd "$D" && git apply --binary "$C/$h.patch") > "$OUT/$h.apply.log" 2>&1 || { echo "== $h: patch failed"; cat "$OUT/$h.apply.log"; continue; }
  mkdir -p "$OUT/$h"
  (cd "$D" && OUT="$OUT/$h" timeout -k 5 ${HT:-175} bash -c "$(cat "$C/$h.gpu")") > "$OUT/$h/console.log" 2>&1
  rc=$?; echo "== $h: rc $rc in $(( $(date +%s) - t )) s"; tail -25 "$OUT/$h/console.log" | cut -c1-220; tar -C "$OUT" -czf "$OUT/$h.tgz" "$h" "$h.apply.log" && rm -rf "$OUT/$h" "$OUT/$h.apply.log"
done
