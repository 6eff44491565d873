#!/usr/bin/env bash
# Before a device call, on this machine: the call's GPU tests run under Triton's interpreter and every kernel launch
# they make compiled for sm_90 by the device's Triton (tools/gpu_compile.py), so that a compile error costs seconds
# here instead of a device call. Usage: bash bench/preflight.sh TESTS...   (e.g. the call's PYTEST_TESTS)
#   TRITON_DEVICE_VERSION (default 3.6.0, the device image's: .library/device/KINDS.md), TRITON_DIR (its unpacked copy,
#   default /tmp/triton<version digits>; fetched with pip download when absent).
set -euo pipefail
cd "$(dirname "$0")/.."
ver=${TRITON_DEVICE_VERSION:-3.6.0}
dir=${TRITON_DIR:-/tmp/triton$(echo "$ver" | tr -d . | cut -c1-2)}
if [ ! -d "$dir/triton" ]; then
  tmp=$(mktemp -d)
  python -m pip download -q "triton==$ver" --no-deps -d "$tmp"
  mkdir -p "$dir" && python -m zipfile -e "$tmp"/triton-"$ver"-*.whl "$dir"
  chmod +x "$dir"/triton/backends/nvidia/bin/*
  rm -rf "$tmp"
fi
python -m tools.gpu_compile "$@" --triton "$dir" --quiet
