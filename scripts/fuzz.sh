#!/usr/bin/env bash
# Runs every libFuzzer target in BUILD (default build/fuzz) for SECONDS each (default 60) from its
# committed seeds in fuzz/corpus/NAME; inputs it discovers go to BUILD/corpus/NAME. Prints the
# executions and fails when any target crashes (the reproducer is left in BUILD/crash-*).
set -uo pipefail
build=${1:-build/fuzz}
seconds=${2:-60}
status=0
for src in fuzz/*_fuzz.cpp; do
  name=$(basename "$src" .cpp)
  corpus=${name%_fuzz}
  mkdir -p "$build/corpus/$corpus"
  log="$build/$name.log"
  "$build/$name" -max_total_time="$seconds" -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="$build/" "$build/corpus/$corpus" "fuzz/corpus/$corpus" > "$log" 2>&1
  rc=$?
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$')
  if [ $rc -ne 0 ]; then
    echo "$name: CRASH after ${execs:-?} executions (see $log)"
    grep -E "ERROR|SUMMARY" "$log" | head -5
    status=1
  else
    echo "$name: ${execs:-?} executions in ${seconds} s, no crash"
  fi
done
exit $status
