#!/bin/sh
# QLoRA end to end on a tiny transformers Llama: `train --lora --qlora` keeps the projections in NF4 with
# double-quantised scales (the ledger's weights far below the f32 run's), checkpoints are PEFT folders,
# resume is bit-exact, `eval --adapter --base-dtype nf4-dq` runs the adapter on the base it trained on;
# a bitsandbytes 4-bit folder evaluates and trains as it is; --embed-dtype bf16 / nf4 hold the frozen
# embedding and head in fewer bytes (eval with the same storage gives the trained run's loss); a config.json
# alone trains a QLoRA on a random base of its shape; misuses are errors.
# usage: qlora.sh OOMLESS_BINARY SOURCE_DIR WORK_DIR
set -u
bin=$1; src=$2; out=$3/qlora
rm -rf "$out"; mkdir -p "$out"
m=$src/tests/golden/models/llama_gqa_untied
python_ids() { i=0; while [ $i -lt 300 ]; do printf '%d ' $(( (i * 37 + 11) % 128 )); i=$((i + 1)); done; echo; }
python_ids > "$out/data.ids"
common="--model $m --data $out/data.ids --seq 32 --batch 2 --lr 1e-2 --warmup 1 --schedule constant --eval-every 0 --lora 4"
"$bin" train $common --qlora --steps 4 --save-every 2 --keep 0 --out "$out/a" > "$out/a.log" 2>&1 || { cat "$out/a.log"; exit 1; }
"$bin" train $common --steps 1 --out "$out/f" > "$out/f.log" 2>&1 || { cat "$out/f.log"; exit 1; }
wq=$(grep -o '"weights":{"current":[0-9]*' "$out/a/metrics.jsonl" | tail -1 | grep -o '[0-9]*$')
wf=$(grep -o '"weights":{"current":[0-9]*' "$out/f/metrics.jsonl" | tail -1 | grep -o '[0-9]*$')
[ "$wq" -lt "$wf" ] || { echo "QLoRA weights $wq not below the f32 run's $wf"; exit 1; }
"$bin" train $common --qlora --steps 2 --out "$out/b" > "$out/b.log" 2>&1 || { cat "$out/b.log"; exit 1; }
"$bin" train $common --qlora --steps 4 --resume "$out/b" > "$out/b2.log" 2>&1 || { cat "$out/b2.log"; exit 1; }
cmp "$out/a/checkpoint-4/adapter_model.safetensors" "$out/b/checkpoint-4/adapter_model.safetensors" ||
  { echo "QLoRA: 2 + resume + 2 steps differ from 4"; exit 1; }
"$bin" eval --model "$m" --adapter "$out/a/checkpoint-4" --base-dtype nf4-dq --data "$out/data.ids" --seq 32 \
  > "$out/eval.log" 2>&1 || { cat "$out/eval.log"; exit 1; }
bnb=$src/tests/golden/bnb4/llama_gqa_untied
"$bin" eval --model "$bnb" --data "$out/data.ids" --seq 32 > "$out/bnb.log" 2>&1 || { cat "$out/bnb.log"; exit 1; }
"$bin" train --model "$bnb" --data "$out/data.ids" --seq 32 --batch 2 --steps 2 --lora 4 --eval-every 0 \
  --out "$out/c" > "$out/c.log" 2>&1 || { cat "$out/c.log"; exit 1; }
if "$bin" train --model "$bnb" --data "$out/data.ids" --seq 32 --steps 1 --out "$out/d" > "$out/d.log" 2>&1; then
  echo "full training of a 4-bit base ran"; exit 1; fi
grep -q "can only be a frozen base" "$out/d.log" || { cat "$out/d.log"; exit 1; }
if "$bin" train --model "$src/tests/golden/gguf/small.gguf" --data "$out/data.ids" --seq 16 --steps 1 --lora 2 --qlora \
  --out "$out/e" > "$out/e.log" 2>&1; then echo "--qlora on a GGUF ran"; exit 1; fi
grep -q "already quantised" "$out/e.log" || { cat "$out/e.log"; exit 1; }
# The embedding and LM head of the frozen base in bf16, then in NF4: fewer weight bytes each time.
"$bin" train $common --qlora --steps 2 --embed-dtype bf16 --out "$out/t1" > "$out/t1.log" 2>&1 || { cat "$out/t1.log"; exit 1; }
"$bin" train $common --qlora --steps 2 --embed-dtype nf4 --out "$out/t2" > "$out/t2.log" 2>&1 || { cat "$out/t2.log"; exit 1; }
w1=$(grep -o '"weights":{"current":[0-9]*' "$out/t1/metrics.jsonl" | tail -1 | grep -o '[0-9]*$')
w2=$(grep -o '"weights":{"current":[0-9]*' "$out/t2/metrics.jsonl" | tail -1 | grep -o '[0-9]*$')
[ "$w2" -lt "$w1" ] && [ "$w1" -lt "$wq" ] || { echo "weights: nf4 tables $w2, bf16 $w1, f32 $wq"; exit 1; }
"$bin" eval --model "$m" --adapter "$out/t2/checkpoint-2" --base-dtype nf4-dq --embed-dtype nf4 --data "$out/data.ids" \
  --seq 32 > "$out/t2.eval" 2>&1 || { cat "$out/t2.eval"; exit 1; }
if "$bin" train $common --qlora --steps 1 --embed-dtype bf16 --modules-to-save lm_head --out "$out/t3" > "$out/t3.log" 2>&1; then
  echo "--embed-dtype bf16 with --modules-to-save ran"; exit 1; fi
grep -q "drop one" "$out/t3.log" || { cat "$out/t3.log"; exit 1; }
if "$bin" train $common --steps 1 --embed-dtype fp16 --out "$out/t4" > "$out/t4.log" 2>&1; then echo "fp16 tables ran"; exit 1; fi
grep -q "supported: auto, fp32, bf16, nf4" "$out/t4.log" || { cat "$out/t4.log"; exit 1; }
# A config.json alone: the same shape at random (no weights file), trained as a QLoRA.
mkdir -p "$out/shape" && cp "$m/config.json" "$out/shape/config.json"
"$bin" train --model "$out/shape/config.json" --data "$out/data.ids" --seq 32 --steps 2 --lora 4 --qlora --eval-every 0 \
  --out "$out/s" > "$out/s.log" 2>&1 || { cat "$out/s.log"; exit 1; }
if "$bin" eval --model "$out/shape" --data "$out/data.ids" --seq 32 > "$out/s2.log" 2>&1; then echo "a folder without weights ran"; exit 1; fi
grep -q "give the file itself" "$out/s2.log" || { cat "$out/s2.log"; exit 1; }
echo "qlora: ok (weights $wq bytes vs $wf in f32; tables bf16 $w1, nf4 $w2)"
