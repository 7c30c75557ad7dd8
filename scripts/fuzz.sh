#!/usr/bin/env bash
# Runs every libFuzzer target in BUILD (default build/sanitize, the sanitizer tree) for SECONDS each
# (default 60) from its committed seeds in fuzz/corpus/NAME; inputs it discovers go to BUILD/corpus/NAME.
# Prints the executions and fails when any target crashes, reports undefined behaviour, or spends more than
# 25 s on one input (the reproducer is left in BUILD/crash-* or BUILD/timeout-*). FUZZ_JOBS targets run side
# by side (default: one per core).
set -uo pipefail
build=${1:-build/sanitize}
seconds=${2:-60}
jobs=${FUZZ_JOBS:-$(nproc)}  # targets side by side (each fuzzer is one thread)
status=0
names=()
for src in fuzz/*_fuzz.cpp; do
  name=$(basename "$src" .cpp)
  corpus=${name%_fuzz}
  mkdir -p "$build/corpus/$corpus"
  if [ ! -x "$build/$name" ]; then
    echo "$name: not built ($build/$name is missing; is $src in the fuzz build?)"
    status=1
    continue
  fi
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  ( "$build/$name" -max_total_time="$seconds" -timeout=25 -rss_limit_mb=4096 -print_final_stats=1 \
      -artifact_prefix="$build/" "$build/corpus/$corpus" "fuzz/corpus/$corpus" > "$build/$name.log" 2>&1
    echo $? > "$build/$name.rc" ) &
  names+=("$name")
done
wait
for name in "${names[@]}"; do
  corpus=${name%_fuzz}
  log="$build/$name.log"
  rc=$(cat "$build/$name.rc")
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$')
  # The last status line: coverage (edges), features and the corpus the run ended with.
  last=$(grep -o 'cov: [0-9]* ft: [0-9]* corp: [0-9]*' "$log" | tail -1)
  found=$(find "$build/corpus/$corpus" -type f | wc -l)
  if [ "$rc" -ne 0 ]; then
    echo "$name: CRASH after ${execs:-?} executions (see $log)"
    grep -E -B3 "==[0-9]+== ?ERROR" "$log" | head -6  # with what the target printed before it
    grep -E "SUMMARY|Test unit written" "$log" | head -2
    status=1
  else
    echo "$name: ${execs:-?} executions in ${seconds} s, no crash; ${last:-?} inputs; $found in $build/corpus/$corpus"
  fi
done
exit $status
