#!/bin/sh
# `oomless train --lora` end to end on preset:micro: checkpoints are PEFT adapter folders (no model
# weights), 2 steps + resume + 2 steps give the adapter bytes of 4 uninterrupted steps, `eval --adapter`
# and `generate --adapter` run the adapted model, `merge` folds it into a Hugging Face folder whose eval
# loss is the adapted model's, and bad settings are clear errors. The same for DoRA (--dora): magnitudes
# saved under PEFT's keys, resume bit-exact, merge equal to the adapter.
# usage: train_lora.sh OOMLESS_BINARY SOURCE_DIR WORK_DIR
set -u
bin=$1; src=$2; out=$3/train_lora
rm -rf "$out"; mkdir -p "$out"
head -c 60000 "$src/data/kjv/train.txt" > "$out/train.txt"
head -c 20000 "$src/data/kjv/eval.txt" > "$out/eval.txt"
common="--model preset:micro --data $out/train.txt --seq 64 --batch 2 --lr 1e-2 --warmup 1 --schedule constant --eval-every 0 --lora 4 --lora-targets q,v,down --lora-dropout 0.1"
"$bin" train $common --steps 4 --save-every 2 --keep 0 --out "$out/a" > "$out/a.log" 2>&1 || { cat "$out/a.log"; exit 1; }
ck=$out/a/checkpoint-4
for f in adapter_config.json adapter_model.safetensors optimizer.safetensors trainer_state.json; do
  [ -s "$ck/$f" ] || { echo "the checkpoint has no $f"; ls "$ck"; exit 1; }
done
[ ! -e "$ck/model.safetensors" ] || { echo "an adapter checkpoint must not hold the base weights"; exit 1; }
grep -q '"peft_type": "LORA"' "$ck/adapter_config.json" || { cat "$ck/adapter_config.json"; exit 1; }
grep -q '"r": 4' "$ck/adapter_config.json" || { cat "$ck/adapter_config.json"; exit 1; }
# What trains and what is frozen: metrics, progress and report.
grep -q '"params":{"trainable":[1-9][0-9]*,"trainable_bytes":[0-9]*,"frozen":[1-9]' "$out/a/metrics.jsonl" ||
  { echo "metrics.jsonl lacks the trainable/frozen counts"; tail -1 "$out/a/metrics.jsonl"; exit 1; }
grep -q "trainable parameters .*frozen base" "$out/a.log" || { echo "no trainable/frozen line"; exit 1; }
grep -q "Trainable parameters [0-9]* (.*); frozen [0-9]*" "$out/a/report.html" || { echo "report lacks the counts"; exit 1; }
# Resume: 2 steps, then 2 more, equals 4 steps bitwise (a constant schedule: --steps may change on resume).
"$bin" train $common --steps 2 --out "$out/b" > "$out/b.log" 2>&1 || { cat "$out/b.log"; exit 1; }
"$bin" train $common --steps 4 --resume "$out/b" > "$out/b2.log" 2>&1 || { cat "$out/b2.log"; exit 1; }
cmp "$ck/adapter_model.safetensors" "$out/b/checkpoint-4/adapter_model.safetensors" ||
  { echo "2 + resume + 2 steps differ from 4 steps"; exit 1; }
cmp "$out/a/checkpoint-2/adapter_model.safetensors" "$ck/adapter_model.safetensors" > /dev/null &&
  { echo "the adapter did not change between steps 2 and 4"; exit 1; }
# --resume with another rank is refused.
if "$bin" train $common --lora 8 --steps 6 --resume "$out/b" > "$out/c.log" 2>&1; then echo "resume with another rank ran"; exit 1; fi
grep -q -- "--lora was 4" "$out/c.log" || { cat "$out/c.log"; exit 1; }
# eval with the adapter differs from the base; merge gives the same loss as the adapter.
base=$("$bin" eval --model preset:micro --data "$out/eval.txt" --seq 64 --json) || exit 1
with=$("$bin" eval --model preset:micro --adapter "$ck" --data "$out/eval.txt" --seq 64 --json) || exit 1
[ "$base" != "$with" ] || { echo "the adapter changed nothing"; exit 1; }
"$bin" merge --model preset:micro --adapter "$ck" --out "$out/merged" > "$out/merge.log" 2>&1 || { cat "$out/merge.log"; exit 1; }
merged=$("$bin" eval --model "$out/merged" --data "$out/eval.txt" --seq 64 --json) || exit 1
loss() { echo "$1" | sed 's/.*"loss": *\([0-9.e+-]*\).*/\1/'; }
awk -v a="$(loss "$with")" -v b="$(loss "$merged")" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d < 1e-5 * a) }' ||
  { echo "merged loss $(loss "$merged") differs from the adapter's $(loss "$with")"; exit 1; }
"$bin" generate --model preset:micro --adapter "$ck" --prompt "And God said" --max-new 8 > "$out/gen.log" 2>&1 ||
  { cat "$out/gen.log"; exit 1; }
# Errors.
expect_error() {  # expect_error PATTERN ARGS...
  pat=$1; shift
  if "$bin" "$@" > "$out/err.log" 2>&1; then echo "succeeded: $*"; exit 1; fi
  grep -q -- "$pat" "$out/err.log" || { echo "expected '$pat' from: $*"; cat "$out/err.log"; exit 1; }
}
expect_error "unknown projection 'qq'" train $common --lora-targets qq --steps 1 --out "$out/e1"
expect_error "r may be at most" train $common --lora 100000 --steps 1 --out "$out/e2"
expect_error "holds no adapter_config.json" eval --model preset:micro --adapter "$out" --data "$out/eval.txt" --seq 64
expect_error "differ from this run" train $common --lora 8 --adapter "$ck" --steps 1 --out "$out/e3"
expect_error "is not part of a rank-4 LoRA\|has shape" eval --model preset:tiny --adapter "$ck" --data "$out/eval.txt" --seq 64
expect_error "supported: embed_tokens, lm_head" train $common --modules-to-save norm --steps 1 --out "$out/e4"
# modules_to_save: lm_head trained beside the adapter, saved under PEFT's key, read back by eval.
"$bin" train $common --steps 2 --modules-to-save lm_head --out "$out/m" > "$out/m.log" 2>&1 || { cat "$out/m.log"; exit 1; }
grep -q "base_model.model.lm_head.weight" "$out/m/checkpoint-2/adapter_model.safetensors" ||
  { echo "no lm_head in the adapter"; exit 1; }
grep -q '"lm_head"' "$out/m/checkpoint-2/adapter_config.json" || { echo "modules_to_save not written"; exit 1; }
"$bin" eval --model preset:micro --adapter "$out/m/checkpoint-2" --data "$out/eval.txt" --seq 64 > "$out/m.eval" 2>&1 ||
  { cat "$out/m.eval"; exit 1; }
# DoRA: magnitude vectors in the adapter, use_dora in its config, resume bit-exact, merge = the adapter.
dora="--model preset:micro --data $out/train.txt --seq 64 --batch 2 --lr 1e-2 --warmup 1 --schedule constant --eval-every 0 --lora 4 --dora"
"$bin" train $dora --steps 4 --save-every 2 --keep 0 --out "$out/d" > "$out/d.log" 2>&1 || { cat "$out/d.log"; exit 1; }
dk=$out/d/checkpoint-4
grep -q '"use_dora": true' "$dk/adapter_config.json" || { cat "$dk/adapter_config.json"; exit 1; }
grep -q "base_model.model.model.layers.0.mlp.down_proj.lora_magnitude_vector\"" "$dk/adapter_model.safetensors" ||
  { echo "no DoRA magnitude under PEFT's key"; exit 1; }
"$bin" train $dora --steps 2 --out "$out/d2" > "$out/d2.log" 2>&1 || { cat "$out/d2.log"; exit 1; }
"$bin" train $dora --steps 4 --resume "$out/d2" > "$out/d3.log" 2>&1 || { cat "$out/d3.log"; exit 1; }
cmp "$dk/adapter_model.safetensors" "$out/d2/checkpoint-4/adapter_model.safetensors" ||
  { echo "DoRA: 2 + resume + 2 steps differ from 4 steps"; exit 1; }
dwith=$("$bin" eval --model preset:micro --adapter "$dk" --data "$out/eval.txt" --seq 64 --json) || exit 1
[ "$base" != "$dwith" ] || { echo "the DoRA adapter changed nothing"; exit 1; }
"$bin" merge --model preset:micro --adapter "$dk" --out "$out/dmerged" > "$out/dmerge.log" 2>&1 || { cat "$out/dmerge.log"; exit 1; }
dmerged=$("$bin" eval --model "$out/dmerged" --data "$out/eval.txt" --seq 64 --json) || exit 1
awk -v a="$(loss "$dwith")" -v b="$(loss "$dmerged")" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d < 1e-5 * a) }' ||
  { echo "DoRA merged loss $(loss "$dmerged") differs from the adapter's $(loss "$dwith")"; exit 1; }
# DoRA trains with dropout (PEFT's form) and saves it in its adapter_config.json.
"$bin" train $dora --lora-dropout 0.1 --steps 2 --out "$out/dd" > "$out/dd.log" 2>&1 || { cat "$out/dd.log"; exit 1; }
grep -q '"lora_dropout": *0.1' "$out/dd/checkpoint-2/adapter_config.json" &&
  grep -q '"use_dora": *true' "$out/dd/checkpoint-2/adapter_config.json" ||
  { echo "DoRA with dropout: adapter_config.json"; cat "$out/dd/checkpoint-2/adapter_config.json"; exit 1; }
expect_error "differ from this run" train $common --adapter "$dk" --lora-dropout 0 --steps 1 --out "$out/e6"
expect_error "--dora needs --lora r" train --model preset:micro --data "$out/train.txt" --dora --steps 1 --out "$out/e7"
echo "train --lora: ok"
