"""`oomless estimate` beside what the run then holds: for each configuration, the estimate (--json), one step of
`oomless train` (its ledger, from metrics.jsonl) and the process's peak RSS (/usr/bin/time -v). Prints, per run:
the estimated and measured Device + Host peaks, the largest error of any category, and RSS minus the ledger
(the fixed part: the binary, the tokenizer, the allocator, thread stacks).

Run: python3 bench/estimate/sweep.py [--binary build/release/oomless] [--out bench/estimate/results/sweep.jsonl]
      [--only NAME]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TINYLLAMA = os.path.join(ROOT, "bench/shapes/tinyllama-1.1b/config.json")

# (name, flags): --model and --seq included; one step, batch 1.
CONFIGS = [
    ("tiny full", "--model preset:tiny --seq 256"),
    ("tiny bf16 none", "--model preset:tiny --seq 1024 --dtype bf16 --save-policy none"),
    ("tiny qlora", "--model preset:tiny --seq 512 --lora 16 --qlora"),
    ("tiny chunk kv host", "--model preset:tiny --seq 2048 --chunk 256 --kv-offload host"),
    ("smollm2 full", "--model preset:smollm2-135m --seq 256"),
    ("smollm2 adamw8bit selective", "--model preset:smollm2-135m --seq 512 --optim adamw8bit --save-policy selective"),
    ("smollm2 act offload disk", "--model preset:smollm2-135m --seq 512 --act-offload disk"),
    ("smollm2 galore", "--model preset:smollm2-135m --seq 256 --optim galore"),
    ("smollm2 lora dora", "--model preset:smollm2-135m --seq 512 --lora 16 --dora"),
    ("smollm2 qlora bf16", "--model preset:smollm2-135m --seq 1024 --lora 16 --qlora --dtype bf16"),
    ("smollm2 chunk disk sparse", "--model preset:smollm2-135m --seq 4096 --chunk 512 --kv-offload disk --sparse-pages 4 "
     "--optim-state disk"),
    ("tinyllama-1.1b full", f"--model {TINYLLAMA} --seq 256"),
    ("tinyllama-1.1b adamw8bit none", f"--model {TINYLLAMA} --seq 1024 --optim adamw8bit --save-policy none"),
    ("tinyllama-1.1b qlora", f"--model {TINYLLAMA} --seq 1024 --lora 16 --qlora"),
]


def ram_peak(mem):
    return sum(mem[t]["total"]["peak"] for t in ("device", "host") if t in mem)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=os.path.join(ROOT, "build/release/oomless"))
    ap.add_argument("--out", default=None, help="append one JSON line per run here")
    ap.add_argument("--only", default=None, help="run the configurations whose name contains this")
    args = ap.parse_args()
    cpu = subprocess.run([args.binary, "--version"], capture_output=True, text=True).stdout.splitlines()[1]
    print(cpu)
    print(f"{'run':34} {'estimate':>10} {'ledger':>10} {'err':>7} {'worst category':>22} {'RSS':>10} {'RSS-ledger':>10}")
    rows = []
    for name, flags in CONFIGS:
        if args.only and args.only not in name:
            continue
        f = flags.split()
        est = json.loads(subprocess.run([args.binary, "estimate", *f, "--json"], capture_output=True, text=True,
                                        check=True).stdout)
        out = tempfile.mkdtemp(prefix="oomless-est-", dir=os.path.join(ROOT, "build"))
        data = []
        if "config.json" in flags:  # a shape alone has no tokenizer: token ids as data
            ids = os.path.join(out, "data.ids")
            with open(ids, "w") as d:
                d.write(" ".join(str((i * 7919) % 30000 + 3) for i in range(20000)) + "\n")
            data = ["--data", ids]
        try:
            p = subprocess.run(["/usr/bin/time", "-v", args.binary, "train", *f, *data, "--steps", "1", "--batch", "1",
                                "--eval-every", "0", "--save-every", "0", "--save-optimizer", "no", "--save-dtype", "bf16",
                                "--out", out + "/run"],
                               capture_output=True, text=True)
            if p.returncode != 0:
                print(f"{name}: train failed:\n{p.stderr[-2000:]}", file=sys.stderr)
                continue
            rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1)) * 1024
            with open(os.path.join(out, "run", "metrics.jsonl")) as m:
                mem = json.loads(m.readline())["memory"]
        finally:
            shutil.rmtree(out, ignore_errors=True)
        e = est["estimate"]
        worst, worst_name = 0.0, "-"
        for tier in ("device", "host", "disk"):
            for cat in ("weights", "grads", "optimizer", "adapter", "activations", "kv", "kv_grad", "workspace"):
                got = mem.get(tier, {}).get(cat, {}).get("peak", 0)
                want = e[tier][cat]
                if max(got, want) < 4096:
                    continue
                err = (want - got) / got if got else 1.0
                if abs(err) > abs(worst):
                    worst, worst_name = err, f"{tier} {cat}"
        led = ram_peak(mem)
        row = {"run": name, "flags": flags, "estimate": e["ram_peak"], "ledger": led, "rss": rss,
               "worst_category": worst_name, "worst_error": worst, "cpu": cpu}
        rows.append(row)
        gib = 1 << 30
        print(f"{name:34} {e['ram_peak'] / gib:9.3f}G {led / gib:9.3f}G {100 * (e['ram_peak'] - led) / led:6.2f}% "
              f"{worst_name:>15} {100 * worst:5.2f}% {rss / gib:9.3f}G {(rss - led) / (1 << 20):8.0f}M", flush=True)
        if args.out:
            with open(args.out, "a") as o:
                o.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
