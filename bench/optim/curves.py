#!/usr/bin/env python3
"""Loss curves of one model trained with different optimizers (or any other flag sets) from the same
init and data: `oomless train` once per variant, the same seed, data and schedule. Writes the curves as an
SVG, one JSON line per variant (final loss = mean of the last 10 steps' training loss, and the held-out
loss at the end), and prints a Markdown table with each variant's final loss relative to the first one.

usage: bench/optim/curves.py [--bin build/release/oomless] [--model preset:tiny] [--steps 200]
       [--variant NAME=FLAGS]... [--out bench/optim/results/NAME] [-- extra train flags for every variant]
default variants: adamw="--optim adamw", adamw8bit="--optim adamw8bit".
Needs only Python 3's standard library.
"""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time


def run(bin_, model, steps, flags, extra, out):
    shutil.rmtree(out, ignore_errors=True)
    cmd = [bin_, "train", "--model", model, "--steps", str(steps), "--out", out, "--save-every", "0",
           "--eval-every", str(max(steps // 4, 1)), "--seed", "1"] + flags + extra
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"curves.py: {' '.join(cmd)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if l.strip()]
    train = [r for r in rows if r.get("type", "train") != "eval"]
    evals = [r for r in rows if r.get("type") == "eval"]
    return train, evals, time.time() - t0


def svg(curves, path, title):
    W, H, L, B = 720, 420, 60, 40
    allv = [v for _, c in curves for v in c]
    lo, hi = min(allv), max(allv)
    n = max(len(c) for _, c in curves)
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    x = lambda i: L + (W - L - 20) * i / max(n - 1, 1)
    y = lambda v: 20 + (H - B - 20) * (hi - v) / max(hi - lo, 1e-9)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{L}" y="14">{title}</text>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - 20}" y2="{H - B}" stroke="black"/>',
           f'<line x1="{L}" y1="20" x2="{L}" y2="{H - B}" stroke="black"/>']
    for k in range(5):
        v = lo + (hi - lo) * k / 4
        out.append(f'<text x="4" y="{y(v) + 4:.1f}">{v:.3f}</text>')
    out.append(f'<text x="{W // 2}" y="{H - 8}">step (1..{n})</text>')
    for j, (name, c) in enumerate(curves):
        pts = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(c))
        col = colours[j % len(colours)]
        out.append(f'<polyline fill="none" stroke="{col}" stroke-width="1.2" points="{pts}"/>')
        out.append(f'<text x="{W - 200}" y="{40 + 16 * j}" fill="{col}">{name}</text>')
    out.append("</svg>")
    open(path, "w").write("\n".join(out) + "\n")


def main():
    argv = sys.argv[1:]
    extra = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default="build/release/oomless")
    ap.add_argument("--model", default="preset:tiny")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--variant", action="append", default=[], help="NAME=FLAGS")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    variants = [v.split("=", 1) for v in a.variant] or [["adamw", "--optim adamw"], ["adamw8bit", "--optim adamw8bit"]]
    out = a.out or os.path.join("bench", "optim", "results", f"curves-{time.strftime('%Y-%m-%d')}")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    work = os.path.join("build", "curves-runs", os.path.basename(out))
    curves, rows = [], []
    for name, flags in variants:
        train, evals, secs = run(a.bin, a.model, a.steps, shlex.split(flags), extra, os.path.join(work, name))
        losses = [r["loss"] for r in train]
        tail = losses[-10:]
        rec = {"variant": name, "flags": flags, "extra": " ".join(extra), "model": a.model, "steps": a.steps,
               "final_loss": sum(tail) / len(tail), "eval_loss": evals[-1]["loss"] if evals else None,
               "seconds": round(secs, 1), "losses": losses}
        rows.append(rec)
        curves.append((name, losses))
        print(f"{name}: final {rec['final_loss']:.4f} eval {rec['eval_loss']} ({secs:.0f} s)", file=sys.stderr)
    with open(out + ".jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    svg(curves, out + ".svg", f"{a.model}, {a.steps} steps: training loss")
    base = rows[0]
    print(f"| variant | flags | final loss (mean of last 10 steps) | vs {base['variant']} | held-out loss | vs {base['variant']} |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ev = r["eval_loss"]
        rel_ev = f"{(ev / base['eval_loss'] - 1) * 100:+.2f}%" if ev and base["eval_loss"] else "-"
        print(f"| {r['variant']} | `{r['flags']}` | {r['final_loss']:.4f} | {(r['final_loss'] / base['final_loss'] - 1) * 100:+.2f}% "
              f"| {ev if ev is None else f'{ev:.4f}'} | {rel_ev} |")
    print(f"\ncurves: {out}.svg, data: {out}.jsonl")


if __name__ == "__main__":
    main()
