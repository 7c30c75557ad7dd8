#!/usr/bin/env bash
# Regenerates data/kjv/train.txt and data/kjv/eval.txt from Debian's King James Version packages
# (bible-kjv-text holds the compressed text, bible-kjv the `bible` program that prints it).
# Deterministic: the same package version gives byte-identical files; `--check` compares the
# result with the SHA-256 sums recorded below (and in data/README.md) instead of writing.
#
#   scripts/make_corpus.sh          # writes data/kjv/{train,eval}.txt
#   scripts/make_corpus.sh --check  # regenerates into a temporary folder and verifies the sums
#
# Layout of both files: a book/chapter heading line ("Genesis 1"), a blank line, one verse per line
# ("1 In the beginning God created the heaven and the earth."), a blank line before the next heading.
# Split: train = Genesis 1:1 .. Philippians 4:23, eval = Colossians 1:1 .. Revelation 22:21 (the
# last 16 of 66 books, about 5% of the bytes). Nothing is trimmed: the whole text is ~4.3 MB.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
expected_version="4.38"
train_sha="0f14f44b508eb11762f967c59017313af4f474b1fedfd8b3f1841b560d184627"
eval_sha="3446a0813f60b63a3928f8f12d9c5449ef08c9815406b8f43178e881f0c69500"

need=()
for p in bible-kjv bible-kjv-text; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  sudo_cmd=()
  [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq >&2
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
fi
version="$(dpkg-query -W -f='${Version}' bible-kjv-text)"
[ "$version" = "$expected_version" ] ||
  echo "make_corpus: bible-kjv-text is $version, the recorded files come from $expected_version" >&2

out="$root/data/kjv"
if [ "${1:-}" = --check ]; then out="$(mktemp -d)"; trap 'rm -rf "$out"' EXIT; fi
mkdir -p "$out"

# -p /usr/lib: read the packaged data file only (bible looks in the current directory first);
# -l10000: one verse per line (no verse is that long). Then: drop the leading blank line, strip the
# verse-number indent and any trailing blanks, LF line endings, a final newline.
dump() {
  (cd / && LC_ALL=C bible -p /usr/lib -l10000 "$1") |
    LC_ALL=C sed -e 's/\r$//' -e 's/^ *//' -e 's/[ \t]*$//' |
    LC_ALL=C awk 'NR == 1 && $0 == "" { next } { print }'
}
dump gen1:1-phil4:23 > "$out/train.txt"
dump col1:1-rev22:21 > "$out/eval.txt"

if [ "${1:-}" = --check ]; then
  ok=1
  echo "$train_sha  $out/train.txt" | sha256sum -c --quiet - || ok=0
  echo "$eval_sha  $out/eval.txt" | sha256sum -c --quiet - || ok=0
  [ $ok = 1 ] && echo "make_corpus: train.txt and eval.txt match the recorded sums"
  [ $ok = 1 ]
else
  wc -c -l "$out/train.txt" "$out/eval.txt"
  sha256sum "$out/train.txt" "$out/eval.txt"
fi
