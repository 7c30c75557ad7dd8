"""Full fine-tuning with each optimizer side by side: `oomless train --optim NAME` and PyTorch + transformers
(bench/peers/train_torch.py --optim NAME: torch.optim.AdamW fused, bitsandbytes.optim.AdamW8bit or
galore_torch.GaLoreAdamW) on
SmolLM2-135M-Instruct (the f32 Hugging Face folder lora.py makes), the same token stream (oomless's
--dump-tokens), fp32, at --seq T. Per optimizer, --pairs runs of each system in alternating order: tokens/s
(median over the steps after the first), peak RSS (/usr/bin/time -v) and, for oomless, the ledger's peak
bytes per category from metrics.jsonl; ratios are medians over the pairs.

usage: tools/golden/.venv/bin/python bench/peers/optim.py [--optims adamw,adamw8bit,galore] [--seq 1024] [--pairs 2]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from lora import smollm2_hf  # noqa: E402
from run import ROOT, sh, steps_of, timed  # noqa: E402


def ledger_peaks(metrics):
    """{category: peak bytes} summed over tiers, from the last step line of an oomless metrics.jsonl."""
    last = None
    for line in open(metrics):
        r = json.loads(line)
        if r.get("type", "train") != "eval" and "memory" in r:
            last = r["memory"]
    out = {}
    if not last:
        return out
    for tier, cats in last.items():
        if not isinstance(cats, dict):
            continue
        for cat, v in cats.items():
            if isinstance(v, dict) and "peak" in v and cat != "total":
                out[cat] = out.get(cat, 0) + v["peak"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--oomless", default=os.path.join(ROOT, "build/release/oomless"))
    ap.add_argument("--python", default=os.path.join(ROOT, "tools/golden/.venv/bin/python"))
    ap.add_argument("--work", default=os.path.join(ROOT, "build/peers-lora"))
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--optims", default="adamw,adamw8bit")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    init, ids = smollm2_hf(a.oomless, a.work, a.gguf)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), TOKENIZERS_PARALLELISM="false")
    probe = json.loads(sh([a.oomless, "probe", "--json", "--quick", "--threads", str(a.threads)]).stdout)
    print(f"machine: {probe['cpu']} ({probe['isa']}), {a.threads} threads", flush=True)
    common = ["--seq", str(a.seq), "--batch", "1", "--lr", "1e-4", "--warmup", "1", "--min-lr", "1e-4",
              "--weight-decay", "0.1"]
    results = {"probe": probe, "seq": a.seq, "steps": a.steps, "runs": [], "summary": []}

    def tps(rows):
        return statistics.median(r["tokens_per_s"] for r in rows[1:]) if len(rows) > 1 else rows[0]["tokens_per_s"]

    for optim in a.optims.split(","):
        pairs = []
        for p in range(a.pairs):
            rec = {}
            for who in (["oomless", "torch"] if p % 2 == 0 else ["torch", "oomless"]):
                out = os.path.join(a.work, "runs", f"full-{optim}.{who}.{p}")
                subprocess.run(["rm", "-rf", out])
                os.makedirs(os.path.dirname(out), exist_ok=True)
                dump = os.path.join(a.work, f"dump-full-{a.steps}.jsonl")
                if who == "oomless":
                    rss, wall = timed([a.oomless, "train", "--model", init, "--data", ids, "--steps", str(a.steps),
                                       "--threads", str(a.threads), "--eval-every", "0", "--save-every", "0",
                                       "--out", out, "--optim", optim, "--dump-tokens", dump + ".part"] + common,
                                      out + ".log", env)
                    os.replace(dump + ".part", dump)
                    rows = steps_of(os.path.join(out, "metrics.jsonl"))
                    ledger = ledger_peaks(os.path.join(out, "metrics.jsonl"))
                else:
                    rss, wall = timed([a.python, os.path.join(HERE, "train_torch.py"), "--model", init, "--tokens",
                                       dump, "--metrics", out + ".jsonl", "--steps", str(a.steps), "--threads",
                                       str(a.threads), "--lr", "1e-4", "--warmup", "1", "--optim", optim],
                                      out + ".log", env)
                    rows = steps_of(out + ".jsonl")
                    ledger = {}
                rec[who] = {"rss": rss, "wall": wall, "tps": tps(rows), "losses": [r["loss"] for r in rows],
                            "ledger_peak": ledger}
                results["runs"].append({"optim": optim, "pair": p, "system": who, **rec[who]})
            o, t = rec["oomless"], rec["torch"]
            print(f"{optim} pair {p}: tok/s {o['tps']:.0f} vs {t['tps']:.0f} ({o['tps'] / t['tps']:.2f}x); peak RSS "
                  f"{o['rss'] / 2**20:.0f} vs {t['rss'] / 2**20:.0f} MiB ({o['rss'] / t['rss']:.2f}x); losses "
                  f"{o['losses'][0]:.4f}->{o['losses'][-1]:.4f} vs {t['losses'][0]:.4f}->{t['losses'][-1]:.4f}; "
                  f"oomless ledger peaks {o['ledger_peak']}", flush=True)
            pairs.append(rec)
        med = lambda f: statistics.median(f(r) for r in pairs)
        results["summary"].append({"optim": optim, "oomless_tps": med(lambda r: r["oomless"]["tps"]),
                                   "torch_tps": med(lambda r: r["torch"]["tps"]),
                                   "tps_ratio": med(lambda r: r["oomless"]["tps"] / r["torch"]["tps"]),
                                   "oomless_rss": med(lambda r: r["oomless"]["rss"]),
                                   "torch_rss": med(lambda r: r["torch"]["rss"]),
                                   "rss_ratio": med(lambda r: r["oomless"]["rss"] / r["torch"]["rss"]),
                                   "oomless_ledger": pairs[0]["oomless"]["ledger_peak"]})
    path = a.json or os.path.join(a.work, "results-optim.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print("\n| optimizer | oomless tok/s | PyTorch tok/s | ratio | oomless peak RSS | PyTorch peak RSS | ratio | "
          "oomless ledger: optimizer | grads | weights |\n|---|---|---|---|---|---|---|---|---|---|")
    for s in results["summary"]:
        lg = s["oomless_ledger"]
        mib = lambda k: f"{lg.get(k, 0) / 2**20:.0f} MiB"
        print(f"| {s['optim']} | {s['oomless_tps']:.0f} | {s['torch_tps']:.0f} | {s['tps_ratio']:.2f}x | "
              f"{s['oomless_rss'] / 2**20:.0f} MiB | {s['torch_rss'] / 2**20:.0f} MiB | {s['rss_ratio']:.2f}x | "
              f"{mib('optimizer')} | {mib('grads')} | {mib('weights')} |")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
