"""The planner held to what runs do: for each (model, --seq, budget) case, `oomless plan` (its predicted peak and
step time), the run with `--plan` (ledger peak, measured step time), and a measured grid of uniform hand settings
(one --save-policy for every layer x activations in memory or on disk x whole sequences or chunks with K/V in
memory or on disk x optimizer state in memory or on disk) of which those the estimate fits under the budget are
run: the best of them is what a user tuning by hand would find.

Budgets are placed between the smallest run (every layer recomputed, everything that can go to disk on disk) and
keeping everything, at the fractions given, so that the plan must trade.

Run (a quiet machine; each case runs the plan and up to a dozen short trainings):
  python3 bench/plan/validate.py [--binary build/release/oomless] [--steps 4] [--out bench/plan/results/FILE.jsonl]
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

# (model, seq, fraction of the way from the smallest run to keeping everything)
CASES = [
    ("preset:micro", 2048, 0.3), ("preset:micro", 2048, 0.6), ("preset:micro", 4096, 0.5),
    ("preset:tiny", 1024, 0.25), ("preset:tiny", 1024, 0.5), ("preset:tiny", 1024, 0.8),
    ("preset:tiny", 2048, 0.3), ("preset:tiny", 2048, 0.7), ("preset:tiny", 4096, 0.5),
    ("preset:smollm2-135m", 512, 0.5), ("preset:smollm2-135m", 1024, 0.4),
]


def sh(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, **kw)


def estimate(binary, flags):
    p = sh([binary, "estimate", *flags, "--json"])
    if p.returncode not in (0, 3):
        return None
    return json.loads(p.stdout)["estimate"]["ram_peak"]


def train(binary, flags, steps, work):
    """Median step seconds after the first step, and the ledger's Device + Host peak."""
    out = tempfile.mkdtemp(prefix="run-", dir=work)
    p = sh([binary, "train", *flags, "--steps", str(steps), "--eval-every", "0", "--save-every", "0", "--out", out])
    if p.returncode != 0:
        return None, None, p.stderr[-600:]
    secs, peak = [], 0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            o = json.loads(line)
            if o.get("type") != "train":
                continue
            secs.append(o["tokens_per_s"])
            m = o["memory"]
            peak = max(peak, sum(m[t]["total"]["peak"] for t in ("device", "host") if t in m))
    shutil.rmtree(out, ignore_errors=True)
    tok = sorted(secs[1:] or secs)
    return tok[len(tok) // 2], peak, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=os.path.join(ROOT, "build/release/oomless"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None, help="cases whose model contains this")
    ap.add_argument("--first", type=int, default=None, help="only the first N cases")
    ap.add_argument("--skip", type=int, default=0, help="skip the first N cases")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="oomless-plan-", dir=os.path.join(ROOT, "build"))
    cpu = sh([a.binary, "--version"]).stdout.splitlines()[1]
    print(cpu, flush=True)
    print(f"{'case':34} {'plan':36} {'peak est/ledger':>16} {'step pred/meas':>16} {'best grid':>30} {'plan/grid':>9}")
    try:
        for model, seq, frac in CASES[a.skip:a.first]:
            if a.only and a.only not in model:
                continue
            plain = ["--model", model, "--seq", str(seq), "--batch", "1"]
            hi = estimate(a.binary, plain)
            lo = min(x for x in [
                estimate(a.binary, plain + ["--save-policy", "none", "--optim-state", "disk"]),
                *[estimate(a.binary, plain + ["--save-policy", "none", "--chunk", str(c), "--kv-offload", "disk",
                                               "--optim-state", "disk"])
                  for c in (seq // 2, seq // 4, seq // 8) if c >= 256]] if x)
            budget = int(lo + frac * (hi - lo))
            tok = seq  # tokens a step (batch 1)
            p = sh([a.binary, "plan", *plain, "--budget", str(budget), "--out", os.path.join(work, "p.json")])
            if p.returncode != 0:
                print(f"{model} {seq} {frac}: plan failed: {p.stderr[-400:]}", file=sys.stderr)
                continue
            plan = json.load(open(os.path.join(work, "p.json")))
            s = plan["settings"]
            label = f"--save-policy {s['save-policy']}" + (f" --chunk {s['chunk']}" if s["chunk"] else "") + \
                    (f" --act-offload {s['act-offload']}" if s["act-offload"] != "none" else "") + \
                    (f" --kv-offload {s['kv-offload']}" if s["kv-offload"] != "none" else "") + \
                    (f" --optim-state {s['optim-state']}" if s["optim-state"] != "host" else "")
            tps, peak, err = train(a.binary, plain + ["--plan", os.path.join(work, "p.json")], a.steps, work)
            if err:
                print(f"{model} {seq}: the plan's run failed: {err}", file=sys.stderr)
                continue
            measured = tok / tps
            # The grid of uniform hand settings that the estimate fits under the budget.
            grid = []
            for pol in ("all", "selective", "none"):
                for g in ([], ["--act-offload", "disk"], *[["--chunk", str(c)] for c in (seq // 2, seq // 4) if c >= 256],
                          *[["--chunk", str(c), "--kv-offload", "disk"] for c in (seq // 2, seq // 4) if c >= 256]):
                    for o in ([], ["--optim-state", "disk"]):
                        if pol == "none" and g[:1] == ["--act-offload"]:
                            continue
                        f = plain + ["--save-policy", pol] + g + o
                        e = estimate(a.binary, f)
                        if e is not None and e <= budget:
                            grid.append((f, e))
            best, best_flags = None, None
            for f, e in grid:
                t, _, err = train(a.binary, f, a.steps, work)
                if err or t is None:
                    continue
                if best is None or tok / t < best:
                    best, best_flags = tok / t, " ".join(f[len(plain):])
            row = {"model": model, "seq": seq, "budget": budget, "fraction": frac, "plan": label,
                   "predicted_peak": plan["predicted"]["ram_peak"], "ledger_peak": peak,
                   "predicted_step_s": plan["predicted"]["step_seconds"], "measured_step_s": measured,
                   "grid_runs": len(grid), "best_grid_step_s": best, "best_grid": best_flags, "cpu": cpu,
                   "cost_model": plan.get("cost_model")}  # what the plan measured, to see why it chose
            pe = 100 * (row["predicted_peak"] - peak) / peak
            te = 100 * (row["predicted_step_s"] - measured) / measured if row["predicted_step_s"] else float("nan")
            ratio = measured / best if best else float("nan")
            print(f"{model.replace('preset:', '') + f' T={seq} b={budget / 2**20:.0f}M':34} {label[:36]:36} "
                  f"{pe:+7.2f}% {'':>7} {te:+7.1f}% {'':>7} {(best_flags or '-')[:30]:>30} {ratio:8.2f}x", flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
