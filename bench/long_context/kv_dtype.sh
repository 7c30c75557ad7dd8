#!/bin/sh
# One chunk-recurrent training step of preset:smollm2-135m (random init, the bundled corpus) at T tokens,
# for each storage of the K/V history (--kv-dtype fp32, bf16, fp8): peak RSS (/usr/bin/time -v), the
# step's time and loss, and the ledger's K/V bytes by tier (metrics.jsonl), side by side in one invocation.
#
# usage: bench/long_context/kv_dtype.sh [T=16384] [C=4096] [MODE=none] [DTYPES="fp32 bf16 fp8"] [OOMLESS=build/release/oomless]
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
T=${1:-16384}; C=${2:-4096}; mode=${3:-none}; dtypes=${4:-fp32 bf16 fp8}; bin=${5:-$root/build/release/oomless}
work=$root/build/kv-dtype-$T; mkdir -p "$work"
"$bin" probe --quick | head -3
for d in $dtypes; do
  rm -rf "$work/$d"
  echo "== --kv-dtype $d (T $T, --chunk $C, --kv-offload $mode)"
  /usr/bin/time -v "$bin" train --model preset:smollm2-135m --seq "$T" --batch 1 --steps 1 --chunk "$C" --page 64 \
    --kv-offload "$mode" --kv-dtype "$d" --save-policy none --eval-every 0 --save-every 0 --save-optimizer no \
    --out "$work/$d" > "$work/$d.log" 2>&1 || { tail -5 "$work/$d.log"; continue; }
  grep -hE "memory after setup|^step|Maximum resident" "$work/$d.log"
  python3 - "$work/$d/metrics.jsonl" <<'PY'
import json, sys
o = [json.loads(l) for l in open(sys.argv[1]) if '"train"' in l][-1]
kv = {t: c["kv"]["peak"] for t, c in o["memory"].items() if "kv" in c}
print("loss %.6f  tokens/s %.1f  kv peak bytes %s  kv_fp8 %s" % (o["loss"], o["tokens_per_s"], kv, o.get("kv_fp8")))
PY
done
