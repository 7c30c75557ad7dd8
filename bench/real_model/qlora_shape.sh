#!/bin/sh
# One real QLoRA training step on a large model's shape, initialised at random from its config.json alone
# (bench/shapes/NAME/config.json: no weight file; each projection is drawn and quantised to NF4 one matrix
# at a time): LoRA r 16 on all linear layers, T tokens, chunk-recurrent with chunks of C and the K/V history
# on disk. Prints peak RSS (/usr/bin/time -v), the step time and the ledger by category (metrics.jsonl).
# Needs about 6 GiB (Llama-2-7B shape) of RAM; on 2 cores a step takes tens of minutes.
#
# usage: bench/real_model/qlora_shape.sh [SHAPE=llama2-7b] [T=2048] [C=512] [OOMLESS=build/release/oomless]
#   [EMBED=auto]: --embed-dtype of the frozen embedding and head (auto = fp32 here; bf16 as bitsandbytes keeps
#   them, or nf4: a 128K vocabulary's tables are 4.2 GB in fp32)
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
shape=${1:-llama2-7b}; T=${2:-2048}; C=${3:-512}; bin=${4:-$root/build/release/oomless}; embed=${5:-auto}
cfg=$root/bench/shapes/$shape/config.json
work=$root/build/qlora-$shape; rm -rf "$work"; mkdir -p "$work"
V=$(sed -n 's/.*"vocab_size": *\([0-9]*\).*/\1/p' "$cfg")
# Token ids in the model's vocabulary: the bundled corpus through the bundled tokenizer, folded into [0, V).
"$bin" tokenize --model preset:micro --text-file "$root/data/kjv/eval.txt" --no-special |
  tr ' ' '\n' | awk -v V="$V" 'NF { printf "%d\n", $1 % V }' > "$work/data.ids"
"$bin" probe --quick | head -3
/usr/bin/time -v "$bin" train --model "$cfg" --data "$work/data.ids" --seq "$T" --batch 1 --steps 1 --lora 16 \
  --qlora --embed-dtype "$embed" --chunk "$C" --kv-offload disk --spill-dir "$work" --save-policy none --eval-every 0 --save-every 0 \
  --out "$work/run" > "$work/train.log" 2> "$work/time.log" || { cat "$work/train.log" "$work/time.log"; exit 1; }
cat "$work/train.log"
grep -E "Maximum resident|Elapsed" "$work/time.log"
tail -1 "$work/run/metrics.jsonl"
