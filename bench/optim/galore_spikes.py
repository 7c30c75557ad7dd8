#!/usr/bin/env python3
"""GaLore's SVD latency spikes: step times of `oomless train --optim galore` with every projector refreshed
at once (--galore-refresh all) against one layer's per step (staggered), same model, data and seed, one
process each. Prints per variant the median step, the slowest step and the median of the steps on which
`all` refreshes (step 1 and every --galore-gap after), from metrics.jsonl's tokens/s.

usage: bench/optim/galore_spikes.py [--bin build/release/oomless] [--model preset:smollm2-135m] [--seq 256]
       [--gap 10] [--steps 31] [--rank 0] [--out build/galore-spikes]
Needs only Python 3's standard library.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/release/oomless")
    ap.add_argument("--model", default="preset:smollm2-135m")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--gap", type=int, default=10)
    ap.add_argument("--steps", type=int, default=31)
    ap.add_argument("--rank", type=int, default=0, help="0: width / 4")
    ap.add_argument("--out", default="build/galore-spikes")
    a = ap.parse_args()
    rows = {}
    for refresh in ("all", "staggered"):
        out = os.path.join(a.out, refresh)
        shutil.rmtree(out, ignore_errors=True)
        cmd = [a.bin, "train", "--model", a.model, "--seq", str(a.seq), "--batch", "1", "--steps", str(a.steps),
               "--optim", "galore", "--galore-gap", str(a.gap), "--galore-refresh", refresh, "--eval-every", "0",
               "--save-every", "0", "--save-optimizer", "no", "--seed", "1", "--out", out]
        if a.rank:
            cmd += ["--galore-rank", str(a.rank)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode:
            sys.exit(f"galore_spikes.py: {' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
        steps = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"train"' in l]
        rows[refresh] = {r["step"]: a.seq / r["tokens_per_s"] for r in steps}
    refresh_steps = [s for s in rows["all"] if s > 1 and (s - 1) % a.gap == 0]
    print(f"model {a.model}, T {a.seq}, gap {a.gap}, {a.steps} steps; refresh steps of 'all' after step 1: {refresh_steps}")
    print("| refresh | median step | slowest step (which) | median on all's refresh steps | final loss |")
    print("|---|---|---|---|---|")
    for refresh, t in rows.items():
        later = {s: v for s, v in t.items() if s > 1}  # step 1 also takes every first SVD in both
        slow = max(later, key=later.get)
        on = statistics.median(later[s] for s in refresh_steps) if refresh_steps else float("nan")
        final = [json.loads(l) for l in open(os.path.join(a.out, refresh, "metrics.jsonl")) if '"train"' in l][-1]["loss"]
        print(f"| {refresh} | {statistics.median(later.values()):.3f} s | {later[slow]:.3f} s (step {slow}) | {on:.3f} s | {final:.4f} |")


if __name__ == "__main__":
    main()
