#!/bin/sh
# Training steps of preset:smollm2-135m (random init, the bundled corpus) at T tokens with the activations
# kept for backward stored as fp32, bf16 and fp8 (--act-dtype), side by side in one invocation: peak RSS
# (/usr/bin/time -v), the ledger's activation peak, step times and losses (metrics.jsonl), and for fp8 the
# share of saturated and flushed values.
#
# usage: bench/optim/act_dtype.sh [T=1024] [STEPS=3] [POLICY=all] [DTYPES="fp32 bf16 fp8"] [EXTRA=""] [OOMLESS=build/release/oomless]
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
T=${1:-1024}; steps=${2:-3}; policy=${3:-all}; dtypes=${4:-fp32 bf16 fp8}; extra=${5:-}; bin=${6:-$root/build/release/oomless}
work=$root/build/act-dtype-$T; mkdir -p "$work"
"$bin" probe --quick | head -3
for d in $dtypes; do
  rm -rf "$work/$d"
  echo "== --act-dtype $d (T $T, --save-policy $policy $extra)"
  # shellcheck disable=SC2086
  /usr/bin/time -v "$bin" train --model preset:smollm2-135m --seq "$T" --batch 1 --steps "$steps" --save-policy "$policy" \
    --act-dtype "$d" --eval-every 0 --save-every 0 --save-optimizer no --out "$work/$d" $extra > "$work/$d.log" 2>&1 ||
    { tail -5 "$work/$d.log"; continue; }
  grep -hE "memory after setup|Maximum resident" "$work/$d.log"
  python3 - "$work/$d/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"train"' in l]
act = max(c["activations"]["peak"] for c in rows[-1]["memory"].values() if "activations" in c)
tps = [r["tokens_per_s"] for r in rows[1:]] or [rows[0]["tokens_per_s"]]
line = "losses %s  tokens/s (median after step 1) %.1f  ledger activations peak %.1f MiB" % (
    " ".join("%.5f" % r["loss"] for r in rows), statistics.median(tps), act / 2**20)
f = rows[-1].get("act_fp8")
if f:
    a = f["all"]
    line += "  fp8 saturated %.4f%% flushed %.4f%%" % (100 * a["saturated"] / a["values"], 100 * a["flushed"] / a["values"])
print(line)
PY
done
