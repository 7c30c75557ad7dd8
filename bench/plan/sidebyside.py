"""The plan against the best uniform hand setting of each case of bench/plan/validate.py, measured side by side:
the grid's best is the minimum over a dozen noisy runs, which flatters it, so both are run again alternately
(--rounds times each) and their median step times compared.

Run: python3 bench/plan/sidebyside.py bench/plan/results/validate.jsonl [--rounds 3] [--steps 8]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def step_seconds(binary, flags, steps, work):
    out = tempfile.mkdtemp(prefix="run-", dir=work)
    p = subprocess.run([binary, "train", *flags, "--steps", str(steps), "--eval-every", "0", "--save-every", "0",
                        "--out", out], capture_output=True, text=True)
    if p.returncode != 0:
        shutil.rmtree(out, ignore_errors=True)
        raise RuntimeError(p.stderr[-500:])
    tps = []
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            o = json.loads(line)
            if o.get("type") == "train":
                tps.append(o["tokens_per_s"])
    shutil.rmtree(out, ignore_errors=True)
    tps = sorted(tps[1:] or tps)
    return tps[len(tps) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--binary", default=os.path.join(ROOT, "build/release/oomless"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="oomless-sbs-", dir=os.path.join(ROOT, "build"))
    rows = [json.loads(l) for l in open(a.results)]
    try:
        for r in rows:
            base = ["--model", r["model"], "--seq", str(r["seq"]), "--batch", "1"]
            plan, grid = base + r["plan"].split(), base + (r["best_grid"] or "").split()
            tp, tg = [], []
            for _ in range(a.rounds):
                tp.append(r["seq"] / step_seconds(a.binary, plan, a.steps, work))
                tg.append(r["seq"] / step_seconds(a.binary, grid, a.steps, work))
            mp, mg = statistics.median(tp), statistics.median(tg)
            r.update({"sbs_plan_step_s": mp, "sbs_grid_step_s": mg, "sbs_rounds": a.rounds})
            print(f"{r['model']} T={r['seq']} budget {r['budget'] >> 20} MiB: plan {mp:.3f} s, best uniform {mg:.3f} s "
                  f"({r['best_grid']}): plan/uniform {mp / mg:.2f}x", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with open(a.results, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    sys.exit(main())
