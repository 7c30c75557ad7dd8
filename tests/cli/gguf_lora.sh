#!/bin/sh
# A GGUF base kept in its blocks: eval reads the quantised projections through the GEMM's packing and
# gives the loss of the dequantised f32 model to the last digit (--grads forces the f32 path), in fp32
# and bf16; `train --lora` on the GGUF trains an adapter with the base still in its blocks (the weights
# in the ledger stay below the f32 model's), and `eval --adapter` runs it.
# usage: gguf_lora.sh OOMLESS_BINARY SOURCE_DIR WORK_DIR
set -u
bin=$1; src=$2; out=$3/gguf_lora
rm -rf "$out"; mkdir -p "$out"
g=$src/tests/golden/gguf/small.gguf
ids=$src/tests/data/llama_mha_tied.ids
q=$("$bin" eval --model "$g" --data "$ids" --seq 16 --json) || exit 1
f=$("$bin" eval --model "$g" --data "$ids" --seq 16 --json --grads "$out/g.safetensors") || exit 1
[ "$q" = "$f" ] || { echo "quantised and f32 bases differ:"; echo "$q"; echo "$f"; exit 1; }
qb=$("$bin" eval --model "$g" --data "$ids" --seq 16 --json --dtype bf16) || exit 1
fb=$("$bin" eval --model "$g" --data "$ids" --seq 16 --json --dtype bf16 --grads "$out/g2.safetensors") || exit 1
[ "$qb" = "$fb" ] || { echo "bf16: quantised and f32 bases differ:"; echo "$qb"; echo "$fb"; exit 1; }
"$bin" generate --model "$g" --prompt-ids "1 5 9" --max-new 4 > "$out/gen.log" 2>&1 || { cat "$out/gen.log"; exit 1; }
# decoding with the token's activations in 8 bits and in f32 (the default); a bad value is named
for dot in int8 f32; do
  "$bin" generate --model "$g" --prompt-ids "1 5 9" --max-new 4 --ignore-eos --json --decode-dot $dot > "$out/gen-$dot.json" 2>&1 &&
    grep -q '"ids":\[[0-9]*,[0-9]*,[0-9]*,[0-9]*\]' "$out/gen-$dot.json" || { cat "$out/gen-$dot.json"; exit 1; }
done
if "$bin" generate --model "$g" --prompt-ids "1 5 9" --max-new 4 --decode-dot int4 > "$out/bad.log" 2>&1 ||
   ! grep -q -- "--decode-dot int4 is not" "$out/bad.log"; then cat "$out/bad.log"; exit 1; fi
"$bin" train --model "$g" --data "$ids" --seq 16 --batch 2 --steps 3 --lora 2 --lr 1e-2 --warmup 1 --eval-every 0 \
  --out "$out/run" > "$out/train.log" 2>&1 || { cat "$out/train.log"; exit 1; }
w=$(grep -o '"weights":{"current":[0-9]*' "$out/run/metrics.jsonl" | tail -1 | grep -o '[0-9]*$')
"$bin" train --model "$g" --data "$ids" --seq 16 --batch 2 --steps 1 --out "$out/full" > "$out/full.log" 2>&1 ||
  { cat "$out/full.log"; exit 1; }
wf=$(grep -o '"weights":{"current":[0-9]*' "$out/full/metrics.jsonl" | tail -1 | grep -o '[0-9]*$')
[ -n "$w" ] && [ -n "$wf" ] && [ "$w" -lt "$wf" ] || { echo "weights held: adapter run $w, f32 run $wf"; exit 1; }
"$bin" eval --model "$g" --adapter "$out/run/checkpoint-3" --data "$ids" --seq 16 > "$out/eval.log" 2>&1 ||
  { cat "$out/eval.log"; exit 1; }
echo "gguf base in its blocks: ok (weights $w bytes vs $wf in f32)"
