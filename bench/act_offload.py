#!/usr/bin/env python3
"""Saved activations kept on the Device, offloaded to host memory or to a spill file (`train --act-offload`):
for each mode, `oomless train` of one model for a few steps under /usr/bin/time -v, in rotating order over
several rounds. Prints per mode: the ledger's activation bytes by tier (metrics.jsonl), peak RSS, tokens/s
(median of the steps after the first, then the median over rounds), the time compute waited on transfers
(the run's closing line), and that the losses are the same digits in every mode.

usage: bench/act_offload.py [--bin build/release/oomless] [--model preset:smollm2-135m] [--seq 1024]
       [--steps 3] [--rounds 2] [--save-policy all] [--dtype fp32] [--work DIR] [--json FILE]
Needs only Python 3's standard library and /usr/bin/time.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys

MODES = ["none", "host", "disk"]


def run(a, mode, out):
    shutil.rmtree(out, ignore_errors=True)
    cmd = ["/usr/bin/time", "-v", a.bin, "train", "--model", a.model, "--seq", str(a.seq), "--batch", "1",
           "--steps", str(a.steps), "--save-every", "0", "--eval-every", "0", "--save-policy", a.save_policy,
           "--dtype", a.dtype, "--act-offload", mode, "--out", out, "--seed", "1"]
    if mode == "disk":
        cmd += ["--spill-dir", out]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"act_offload.py: {' '.join(cmd)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if l.strip()]
    train = [r for r in rows if r.get("type", "train") == "train"]
    mem = train[-1]["memory"]
    acts = {tier: mem.get(tier, {}).get("activations", {}).get("peak", 0) for tier in ("device", "host", "disk")}
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
    w = re.search(r"compute waited ([0-9.]+) s on transfers \(([0-9.]+)% of", p.stdout)
    return {"mode": mode, "tok_s": statistics.median(r["tokens_per_s"] for r in train[1:] or train),
            "losses": [round(r["loss"], 6) for r in train], "activations": acts,
            "device_total": mem["device"]["total"]["peak"], "peak_rss_kib": int(m.group(1)) if m else None,
            "wait_s": float(w.group(1)) if w else 0.0, "wait_pct": float(w.group(2)) if w else 0.0}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default="build/release/oomless")
    ap.add_argument("--model", default="preset:smollm2-135m")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--save-policy", default="all")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--work", default="build/act-offload")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    res = {m: [] for m in MODES}
    for r in range(a.rounds):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        for mode in order:
            rec = run(a, mode, os.path.join(a.work, mode))
            res[mode].append(rec)
            print(json.dumps(rec), flush=True)
    mib = lambda b: b / 2**20
    base = statistics.median(x["tok_s"] for x in res["none"])
    print(f"\n{a.model}, T = {a.seq}, --save-policy {a.save_policy}, {a.dtype}; medians over {a.rounds} rounds\n")
    print("| --act-offload | activations Device / Host / Disk (ledger) | Device total | peak RSS | tok/s | vs none | "
          "compute waited |")
    print("|---|---|---|---|---|---|---|")
    for mode in MODES:
        xs = res[mode]
        acts = xs[-1]["activations"]
        tok = statistics.median(x["tok_s"] for x in xs)
        rss = statistics.median(x["peak_rss_kib"] for x in xs) / 1024
        wait = statistics.median(x["wait_pct"] for x in xs)
        print(f"| {mode} | {mib(acts['device']):.1f} / {mib(acts['host']):.1f} / {mib(acts['disk']):.1f} MiB | "
              f"{mib(xs[-1]['device_total']):.1f} MiB | {rss:.0f} MiB | {tok:.1f} | {tok / base:.3f}x | {wait:.1f}% |")
    same = all(x["losses"] == res["none"][0]["losses"] for m in MODES for x in res[m])
    print(f"\nlosses the same in every mode and round: {'yes' if same else 'NO'} ({res['none'][0]['losses']})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "runs": res}, f, indent=1)


if __name__ == "__main__":
    main()
