#!/bin/sh
# How OpenMP's waiting threads fare on a quiet machine and beside other work: `oomless train` on
# preset:tiny (fp32, T 256, batch 4), median tokens/s of steps 2..STEPS, under each wait policy of libgomp
# (unset: nothing set, oomless's default: libgomp's own, unless other work keeps the CPUs busy when the
# command starts, then passive (src/cli/main.cpp); spin300000: libgomp's own default, spin 300k iterations
# then sleep; active: spin; passive: sleep at once; spinN: spin N iterations), with 0, 1 and 2 busy
# processes (a shell loop each) beside it.
# Prints one markdown table. Run it on an otherwise idle machine. A run is cut after 120 s (shown as >120s).
#
# usage: bench/threads/wait_policy.sh [OOMLESS=build/release/oomless] [STEPS=8] [REPS=3]
#          [POLICIES="unset active passive spin10000"] [HOGS="0 1 2"]
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${1:-$root/build/release/oomless}; steps=${2:-8}; reps=${3:-3}
policies=${4:-unset spin300000 active passive spin1000}; hog_counts=${5:-0 1 2}
work=$root/build/wait-policy; rm -rf "$work"; mkdir -p "$work"
"$bin" probe --quick | head -4
median() { sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
run() {  # policy hogs -> median tokens/s over reps runs
  policy=$1; hogs=$2; i=0; pids=""
  while [ $i -lt "$hogs" ]; do sh -c 'while :; do :; done' & pids="$pids $!"; i=$((i + 1)); done
  r=0; out=""
  while [ $r -lt "$reps" ]; do
    rm -rf "$work/run"
    case $policy in
      unset) set -- env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT -u OOMLESS_WAIT_CHOSEN ;;
      spin*) set -- env -u OMP_WAIT_POLICY GOMP_SPINCOUNT="${policy#spin}" ;;
      *) set -- env -u GOMP_SPINCOUNT OMP_WAIT_POLICY="$policy" ;;
    esac
    if ! timeout 120 "$@" "$bin" train --model preset:tiny --seq 256 --batch 4 --steps "$steps" --eval-every 0 \
         --save-every 0 --out "$work/run" > "$work/log" 2>&1; then
      for p in $pids; do kill "$p"; done
      echo ">120s"; return
    fi
    t=$(grep -o '"tokens_per_s":[0-9.e+]*' "$work/run/metrics.jsonl" | tail -n +2 | cut -d: -f2 | median)
    out="$out $t"; r=$((r + 1))
  done
  for p in $pids; do kill "$p"; done
  echo "$out" | tr ' ' '\n' | grep . | median | awk '{ printf "%.0f", $1 }'
}
echo
head="| busy processes beside |"; rule="|---|"
for policy in $policies; do head="$head $policy |"; rule="$rule---|"; done
echo "$head"; echo "$rule"
for hogs in $hog_counts; do
  line="| $hogs |"
  for policy in $policies; do line="$line $(run "$policy" "$hogs") |"; done
  echo "$line"
done
echo "(tokens/s, median of $reps runs of steps 2..$steps each)"
