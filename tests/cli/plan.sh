#!/bin/sh
# oomless plan and train --plan / --budget end to end on preset:micro: a budget between keeping nothing and
# keeping everything gets a plan that recomputes some layers; training with it stays under the budget by the
# ledger; train --budget alone plans by itself (explicit flags win); a budget nothing fits and a plan made for
# another run are refused by name.
# usage: plan.sh OOMLESS_BINARY SOURCE_DIR WORK_DIR
set -u
# The cost model timed in three rounds a pair (plan/cost.cpp): this checks what the plan does, not its figures.
export OOMLESS_PLAN_MIN_SECONDS=0
bin=$1; src=$2; work=$3/cli_plan
rm -rf "$work"; mkdir -p "$work"
D=$src/data/kjv/eval.txt
fail() { echo "FAIL: $*"; exit 1; }
M="--model preset:micro --seq 256 --batch 1"
peak() { "$bin" estimate $M "$@" --json | sed 's/.*"ram_peak":\([0-9]*\).*/\1/'; }
lo=$(peak --save-policy none); hi=$(peak)
[ "$lo" -lt "$hi" ] || fail "keeping nothing ($lo) is not below keeping everything ($hi)"
budget=$(( (lo + hi) / 2 ))
"$bin" plan $M --budget "$budget" --out "$work/p.json" --explain > "$work/plan.log" 2>&1 || { cat "$work/plan.log"; fail "plan"; }
grep -q "^plan for preset:micro at --seq 256 under --budget $budget: --save-policy " "$work/plan.log" || { cat "$work/plan.log"; fail "no plan line"; }
grep -q "solved by GLPK (optimal)" "$work/plan.log" || { cat "$work/plan.log"; fail "not solved to optimality"; }
if grep -q -- "--save-policy all$" "$work/plan.log"; then cat "$work/plan.log"; fail "keeping everything cannot fit $budget"; fi
"$bin" train $M --data "$D" --steps 2 --plan "$work/p.json" --out "$work/run" > "$work/train.log" 2>&1 || { cat "$work/train.log"; fail "train --plan"; }
grep -q "oomless train: --plan $work/p.json: --save-policy " "$work/train.log" || { cat "$work/train.log"; fail "no --plan line"; }
grep -Eq "^plan: predicted peak [0-9.]+ [KM]iB, [0-9.]+ s a step; measured peak [0-9.]+ [KM]iB, [0-9.]+ s a step \(median of 1\)$" "$work/train.log" \
  || { cat "$work/train.log"; fail "no predicted-vs-measured line"; }
# the report shows the plan: where it came from, its per-layer choices, predicted beside measured
grep -q "<h2>Plan</h2>" "$work/run/report.html" && grep -q "<td>chosen by</td><td>--plan $work/p.json</td>" "$work/run/report.html" &&
  grep -Eq "<td>peak memory \(device \+ host\)</td><td>predicted [0-9.]+ [KM]iB, measured [0-9.]+ [KM]iB" "$work/run/report.html" &&
  grep -q "<tr><td>0</td><td>" "$work/run/report.html" || fail "report.html has no plan section"
used=$(tail -1 "$work/run/metrics.jsonl" | sed 's/.*"device":{.*"total":{"current":[0-9]*,"peak":\([0-9]*\)}},"host":{.*"total":{"current":[0-9]*,"peak":\([0-9]*\)}}}}.*/\1 \2/')
set -- $used
[ $(( $1 + $2 )) -le "$budget" ] || fail "the planned run held $(( $1 + $2 )) bytes, over --budget $budget"
# --budget alone plans; an explicit --save-policy wins.
"$bin" train $M --data "$D" --steps 1 --budget "$budget" --out "$work/auto" > "$work/auto.log" 2>&1 || { cat "$work/auto.log"; fail "train --budget"; }
grep -q "oomless train: planned for --budget $budget: --save-policy " "$work/auto.log" || { cat "$work/auto.log"; fail "no planning"; }
grep -q "<td>chosen by</td><td>train --budget $budget (no memory option given)</td>" "$work/auto/report.html" || fail "auto plan not in report"
"$bin" train $M --data "$D" --steps 1 --budget "$hi" --save-policy all --out "$work/given" > "$work/given.log" 2>&1 || { cat "$work/given.log"; fail "given"; }
if grep -q "planned for" "$work/given.log"; then fail "planned although --save-policy was given"; fi
# Refused: nothing fits; a plan beside a flag it sets; a plan for another --seq.
if "$bin" plan $M --budget 1MiB --out "$work/none.json" > "$work/none.log" 2>&1; then fail "a plan under 1 MiB"; fi
grep -Eq "nothing fits --budget 1MiB: the smallest run .* holds [0-9.]+ [KM]iB .*give --budget [0-9.]+ MiB or more" "$work/none.log" \
  || { cat "$work/none.log"; fail "no smallest budget named"; }
if "$bin" train $M --data "$D" --steps 1 --plan "$work/p.json" --chunk 128 --out "$work/twice" > "$work/twice.log" 2>&1; then fail "--plan with --chunk"; fi
grep -q -- "--chunk is set by --plan" "$work/twice.log" || { cat "$work/twice.log"; fail "no conflict named"; }
if "$bin" train --model preset:micro --seq 128 --data "$D" --steps 1 --plan "$work/p.json" --out "$work/seq" > "$work/seq.log" 2>&1; then fail "a plan for another --seq"; fi
grep -q "it was made for --seq 256, this run has --seq 128" "$work/seq.log" || { cat "$work/seq.log"; fail "no --seq named"; }
# A cost model's timing setting that is not a number of seconds is refused by name.
if OOMLESS_PLAN_MIN_SECONDS=abc "$bin" plan $M --budget "$budget" --out "$work/env.json" > "$work/env.log" 2>&1; then
  fail "OOMLESS_PLAN_MIN_SECONDS=abc accepted"; fi
grep -q "OOMLESS_PLAN_MIN_SECONDS=abc is not a number of seconds" "$work/env.log" || { cat "$work/env.log"; fail "no error naming OOMLESS_PLAN_MIN_SECONDS"; }
[ ! -e "$work/env.json" ] || fail "a plan written under a refused OOMLESS_PLAN_MIN_SECONDS"
if "$bin" plan $M --budget "$budget" --chunk 128 --out "$work/c.json" > "$work/c.log" 2>&1; then fail "plan with --chunk"; fi
grep -q -- "--chunk is what the plan chooses" "$work/c.log" || { cat "$work/c.log"; fail "no --chunk named"; }
echo "plan: ok (budget $budget between $lo and $hi)"
