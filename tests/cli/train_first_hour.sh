#!/bin/sh
# What a first training run says and refuses: the run described before step 1, defaults by situation,
# errors that name the flag (and leave no run folder behind), warnings for a run that is all warmup or a
# dataset repeated within a step, `--resume DIR` alone continuing bit-exactly, and a second Ctrl-C
# stopping at once without a partial checkpoint.
# usage: train_first_hour.sh OOMLESS_BINARY SOURCE_DIR WORK_DIR
set -u
bin=$1; src=$2; work=$3/train_first_hour
rm -rf "$work"; mkdir -p "$work"
D=$src/data/kjv/eval.txt
fail() { echo "FAIL: $*"; exit 1; }
# expect_error NAME REGEX ARGS...: the command fails and says REGEX (extended grep), and makes no run folder.
expect_error() {
  name=$1; re=$2; shift 2
  if "$bin" "$@" --out "$work/$name.run" > "$work/$name.log" 2>&1; then cat "$work/$name.log"; fail "$name: exit 0"; fi
  grep -Eq -- "$re" "$work/$name.log" || { cat "$work/$name.log"; fail "$name: no '$re' in the output"; }
  [ ! -e "$work/$name.run" ] || fail "$name: the failed run left its folder $work/$name.run"
}
M="train --model preset:micro --data $D --seq 64 --batch 2 --steps 2"
expect_error kv_no_chunk "--kv-offload disk needs --chunk C" $M --kv-offload disk
expect_error page_no_chunk "--page 32 needs --chunk C" $M --page 32
expect_error backend_cuda "the CUDA backend has no kernels yet in this build; use --backend cpu" $M --backend cuda
expect_error backend_unknown "--backend tpu is not a backend oomless has; use cpu or cuda" $M --backend tpu
expect_error spill_no_disk "--spill-dir .* add one of them" $M --spill-dir "$work"
expect_error threads "--threads 4096 is more than this machine's [0-9]+ logical CPUs" $M --threads 4096
expect_error epochs_zero "--epochs must be above 0" train --model preset:micro --data "$D" --epochs 0
expect_error min_lr "--min-lr 0.01 is above --lr 0.001" $M --lr 1e-3 --min-lr 1e-2
expect_error chunk_prime "--chunk 97 has no divisor from 8 to 64" train --model preset:micro --data "$D" --seq 194 --chunk 97 --steps 1
printf '%s\n' '{"messages": [{"role": "user", "content": "Who wrote this?"}]}' \
  '{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]}' > "$work/no_assistant.jsonl"
expect_error no_supervised "has no supervised token in an epoch" train --model preset:micro --data "$work/no_assistant.jsonl" --seq 16 --steps 2
expect_error budget "does not fit --budget 100MB: .*requested [0-9.]+ MiB for grads" train --model preset:tiny --data "$D" --seq 2048 --steps 1 --budget 100MB
grep -q "this run trains every parameter: weights 48.02 MiB, gradients 48.02 MiB, AdamW state 96.04 MiB" "$work/budget.log" \
  || { cat "$work/budget.log"; fail "the budget error does not give the run's static memory"; }
grep -q "changes that fit more: --lora 16 (the base frozen" "$work/budget.log" || { cat "$work/budget.log"; fail "no changes named"; }
grep -q "oomless estimate. with these flags and --budget lists what each change saves; .oomless plan. chooses" "$work/budget.log" \
  || { cat "$work/budget.log"; fail "the budget error does not point to estimate and plan"; }
grep -q "oomless train: no plan: \[plan\] nothing fits --budget 100MB" "$work/budget.log" \
  || { cat "$work/budget.log"; fail "train --budget did not say that no plan fits"; }
expect_error rope_key "rope scaling key \"bad\" is not read by any rope type" $M --rope-scaling '{"rope_type": "linear", "factor": 2, "bad": 1}'
expect_error unknown_flag "unknown option '--lr-warmup'.*run .oomless train --help." $M --lr-warmup 3

# The run before step 1: model, parameters, memory after setup, data, schedule (random init: today's defaults).
"$bin" $M --eval-every 0 --out "$work/described" > "$work/described.log" 2>&1 || { cat "$work/described.log"; fail "described run"; }
for re in "model preset:micro \(preset, random init\): 2 layers" "598.3K trainable parameters" \
          "memory after setup: peak [0-9.]+ [KMG]iB \(weights .*optimizer .*workspace" \
          "data: 1 document; one epoch = [0-9]+ sequences of 64 tokens \([0-9]+ supervised targets\)" \
          "schedule: lr 0.001 \(random-init default\), warmup 2 steps, cosine down to 0.0001; weight decay 0.1" \
          "the default warmup 20 covers the whole run of 2 steps" "^step 1/2 .*memory peak"; do
  grep -Eq -- "$re" "$work/described.log" || { cat "$work/described.log"; fail "no '$re' before or during step 1"; }
done
# A dataset smaller than a step is reported.
head -c 300 "$D" > "$work/tiny.txt"
"$bin" train --model preset:micro --data "$work/tiny.txt" --seq 64 --batch 8 --steps 1 --eval-every 0 --out "$work/tiny" \
  > "$work/tiny.log" 2>&1 || { cat "$work/tiny.log"; fail "tiny run"; }
grep -Eq "the data holds 2 sequences of --seq 64 and a step takes 8: each step repeats the data about 4 times" "$work/tiny.log" \
  || { cat "$work/tiny.log"; fail "tiny dataset not reported"; }

# --resume DIR alone: the saved settings (here not the defaults) continue the run bit-exactly.
R="train --model preset:micro --data $D --seq 64 --batch 2 --steps 4 --lr 3e-3 --warmup 1 --weight-decay 0.05 --save-every 2 --keep 0 --eval-every 0"
"$bin" $R --out "$work/whole" > "$work/whole.log" 2>&1 || { cat "$work/whole.log"; fail "whole run"; }
"$bin" $R --out "$work/split" > "$work/split.log" 2>&1 || { cat "$work/split.log"; fail "split run"; }
rm -rf "$work/split/checkpoint-4"
"$bin" train --resume "$work/split" > "$work/resume.log" 2>&1 || { cat "$work/resume.log"; fail "--resume alone"; }
grep -q "resumed from .*checkpoint-2 (step 2 of 4)" "$work/resume.log" || { cat "$work/resume.log"; fail "did not resume at step 2"; }
cmp -s "$work/whole/checkpoint-4/model.safetensors" "$work/split/checkpoint-4/model.safetensors" || fail "--resume alone is not bit-exact"
# A fixed setting given again with another value is refused.
expect_error resume_changed "--lr was 0.003 in the saved run and is 0.001 now" train --resume "$work/split" --lr 1e-3

# Two Ctrl-C: the first says it will stop after the step, the second stops at once, saving nothing.
"$bin" train --model preset:micro --data "$D" --seq 2048 --batch 16 --steps 1000 --save-every 0 --eval-every 0 \
  --out "$work/sigint" > "$work/sigint.log" 2>&1 &
pid=$!
i=0
while [ $i -lt 600 ]; do
  if grep -q "^step 1/" "$work/sigint.log" 2>/dev/null; then break; fi
  sleep 0.1; i=$((i + 1))
done
kill -INT $pid; sleep 0.05; kill -INT $pid
wait $pid
rc=$?
[ $rc -eq 130 ] || { cat "$work/sigint.log"; fail "expected exit code 130 after two interrupts, got $rc"; }
grep -q "interrupt: stopping after this step and saving a checkpoint" "$work/sigint.log" || { cat "$work/sigint.log"; fail "first interrupt not acknowledged"; }
grep -q "second interrupt: stopping now, without saving" "$work/sigint.log" || { cat "$work/sigint.log"; fail "second interrupt did not stop at once"; }
[ -z "$(ls -A "$work/sigint" | grep checkpoint)" ] || fail "a checkpoint was written after the second interrupt"
echo "first-hour messages, errors, --resume alone and two interrupts behave"
