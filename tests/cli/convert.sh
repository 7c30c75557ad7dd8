#!/bin/sh
# `oomless convert` writes a preset as a Hugging Face folder that loads back to the same model: the folder's
# eval loss (all digits) equals the preset's with the same seed, and a second convert into it is refused.
# usage: convert.sh OOMLESS_BINARY SOURCE_DIR WORK_DIR
set -u
bin=$1; src=$2; out=$3/convert
rm -rf "$out"
"$bin" convert --model preset:micro --seed 3 --out "$out/micro" || exit 1
for f in config.json model.safetensors tokenizer.json tokenizer_config.json; do
  [ -s "$out/micro/$f" ] || { echo "convert wrote no $f"; exit 1; }
done
head -c 20000 "$src/data/kjv/eval.txt" > "$out/eval.txt"
a=$("$bin" eval --model "$out/micro" --data "$out/eval.txt" --seq 128 --json) || exit 1
b=$("$bin" eval --model preset:micro --seed 3 --data "$out/eval.txt" --seq 128 --json) || exit 1
c=$("$bin" eval --model preset:micro --seed 4 --data "$out/eval.txt" --seq 128 --json) || exit 1
[ "$a" = "$b" ] || { echo "converted folder evaluates differently:"; echo "$a"; echo "$b"; exit 1; }
[ "$a" != "$c" ] || { echo "the seed made no difference, so the comparison shows nothing"; exit 1; }
if "$bin" convert --model preset:micro --out "$out/micro" > "$out.again.log" 2>&1; then
  echo "convert into a non-empty folder succeeded"; exit 1
fi
grep -q "already exists and is not an empty folder" "$out.again.log" || { cat "$out.again.log"; exit 1; }
echo "convert: ok"
