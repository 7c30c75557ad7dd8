"""Side by side: `oomless train` and PyTorch + transformers (bench/peers/train_torch.py) train the same
model from the same weights on the same token stream, alternating in one invocation.

For each model (a preset written once with `oomless convert`, so both start from identical safetensors)
and dtype, --pairs pairs of runs; the order inside a pair alternates (oomless first in even pairs). Each run
is measured by /usr/bin/time -v (peak RSS of the whole process) and by its own per-step timer (tokens/s;
the first step, a warm-up, is not counted; median over the remaining steps). Ratios are taken inside each
pair and their median reported. One longer pair (--curve-steps, default 200, fp32) on preset:tiny compares
the loss curves. MFU = model FLOP/s / the machine's GEMM rate from `oomless probe` for the dtype the run
computes in (the same yardstick for both systems: fp32 runs against the fp32 rate, bf16 runs against the bf16
rate, which is the fp32 one where bf16 is widened, on AVX2, and about twice it with AVX512-BF16), with
model FLOPs per token = 6 * (matmul parameters incl. the LM head) + 6 * L * H * D * T (causal attention,
forward + backward).
oomless keeps every activation (--save-policy all) except where --save-policy says otherwise: by default
smollm2-135m bf16 recomputes each block from its input (none), which trades about a third more compute for
the activation memory; PyTorch keeps its activations in every row.

usage: bench/peers/run.py [--oomless build/release/oomless] [--work build/peers] [--pairs 5] ...
Needs tools/golden/.venv (bench/peers/setup.sh creates it).
--smoke (`make test-smoke`): the oomless side only, on preset:micro at 64 tokens, 2 steps per dtype, one pair;
nothing is imported from the venv, so it checks the harness and the oomless commands it drives, not figures.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def sh(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"run.py: {' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return r


def timed(cmd, log, env=None):
    """Runs cmd under /usr/bin/time -v; returns (peak RSS bytes, wall seconds)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        r = subprocess.run(["/usr/bin/time", "-v"] + cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    wall = time.perf_counter() - t0
    text = open(log).read()
    if r.returncode != 0:
        sys.exit(f"run.py: {' '.join(cmd)} failed ({r.returncode}); log {log}:\n{text[-3000:]}")
    rss = [line for line in text.splitlines() if "Maximum resident set size" in line]
    return int(rss[-1].split(":")[1]) * 1024, wall


def steps_of(path):
    rows = []
    for line in open(path):
        r = json.loads(line)
        if r.get("type") == "eval" or "tokens_per_s" not in r:
            continue
        rows.append(r)
    return rows


def flops_per_token(cfg, T):
    E, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    H, Hkv, F = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    D = cfg.get("head_dim") or E // H
    per_layer = E * H * D + 2 * E * Hkv * D + H * D * E + 3 * E * F
    if cfg.get("attention_bias"):
        per_layer += H * D + 2 * Hkv * D
    matmul = L * per_layer + V * E
    return 6.0 * matmul + 6.0 * L * H * D * T


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--oomless", default=os.path.join(ROOT, "build/release/oomless"))
    ap.add_argument("--python", default=os.path.join(ROOT, "tools/golden/.venv/bin/python"))
    ap.add_argument("--work", default=os.path.join(ROOT, "build/peers"))
    ap.add_argument("--models", default="tiny,smollm2-135m")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", default="tiny.fp32=12,tiny.bf16=4,smollm2-135m.fp32=5,smollm2-135m.bf16=1",
                    help="optimizer steps per timed run, per MODEL.DTYPE or MODEL (the first step is a warm-up and "
                         "not counted unless it is the only one)")
    ap.add_argument("--save-policy", default="smollm2-135m.bf16=none",
                    help="oomless --save-policy per MODEL.DTYPE or MODEL (default all): what forward keeps for "
                         "backward; none recomputes each block from its input")
    ap.add_argument("--curve-steps", type=int, default=200, help="steps of the loss-curve pair on tiny (0: none)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--json", default=None, help="results file (default WORK/results.json)")
    ap.add_argument("--smoke", action="store_true",
                    help="oomless only (no PyTorch, no venv): preset:micro, --seq 64, 2 steps, 1 pair, no curve")
    a = ap.parse_args()
    if a.smoke:
        a.models, a.pairs, a.steps, a.curve_steps, a.seq, a.warmup = "micro", 1, "micro=2", 0, 64, 1
    os.makedirs(a.work, exist_ok=True)
    steps = dict(kv.split("=") for kv in a.steps.split(","))
    policies = dict(kv.split("=") for kv in a.save_policy.split(",") if kv)
    policy_of = lambda model, dtype: policies.get(f"{model}.{dtype}", policies.get(model, "all"))
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), TOKENIZERS_PARALLELISM="false")
    # train_torch.py's min-lr and weight decay, given explicitly (oomless's defaults depend on the model).
    common = ["--seq", str(a.seq), "--batch", str(a.batch), "--lr", str(a.lr), "--warmup", str(a.warmup),
              "--min-lr", "1e-4", "--weight-decay", "0.1"]

    probe = json.loads(sh([a.oomless, "probe", "--json", "--threads", str(a.threads)]).stdout)
    peak = probe["gemm_f32_gflops"] * 1e9
    peak_of = {"fp32": peak, "bf16": probe["gemm_bf16_gflops"] * 1e9}
    versions = (["not run (--smoke)", "-"] if a.smoke else
                sh([a.python, "-c", "import torch, transformers; print(torch.__version__, transformers.__version__)"]).stdout.split())
    print(f"machine: {probe['cpu']} ({probe['isa']}; GEMM path {probe.get('gemm_path', '?')}), {a.threads} threads; "
          f"GEMM fp32 {peak / 1e9:.1f}, bf16 {peak_of['bf16'] / 1e9:.1f} GFLOP/s; "
          f"torch {versions[0]}, transformers {versions[1]}", flush=True)

    results = {"probe": probe, "torch": versions[0], "transformers": versions[1], "seq": a.seq, "batch": a.batch,
               "threads": a.threads, "runs": [], "summary": [], "curve": None}

    def prepare(model):
        init = os.path.join(a.work, f"init-{model}")
        if not os.path.exists(os.path.join(init, "model.safetensors")):
            sh([a.oomless, "convert", "--model", f"preset:{model}", "--seed", "0", "--out", init])
        ids = os.path.join(a.work, f"{model}.ids")
        if not os.path.exists(ids):
            out = sh([a.oomless, "tokenize", "--model", init, "--text-file", os.path.join(ROOT, "data/kjv/train.txt"),
                      "--no-special"]).stdout
            with open(ids + ".tmp", "w") as f:
                f.write(out)
            os.replace(ids + ".tmp", ids)
        return init, ids, json.load(open(os.path.join(init, "config.json")))

    def run_oomless(tag, init, ids, dtype, n, policy="all"):
        out = os.path.join(a.work, "runs", tag)
        subprocess.run(["rm", "-rf", out])
        os.makedirs(os.path.dirname(out), exist_ok=True)
        dump = os.path.join(a.work, f"dump-{tag.split('.')[0]}-{n}.jsonl")
        rss, wall = timed([a.oomless, "train", "--model", init, "--data", ids, "--steps", str(n), "--dtype", dtype,
                           "--threads", str(a.threads), "--eval-every", "0", "--save-every", "0", "--out", out,
                           "--dump-tokens", dump + ".part", "--save-policy", policy] + common, out + ".log", env)
        os.replace(dump + ".part", dump)
        return rss, wall, steps_of(os.path.join(out, "metrics.jsonl"))

    def run_torch(tag, init, dtype, n):
        out = os.path.join(a.work, "runs", tag)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        dump = os.path.join(a.work, f"dump-{tag.split('.')[0]}-{n}.jsonl")
        metrics = out + ".jsonl"
        rss, wall = timed([a.python, os.path.join(HERE, "train_torch.py"), "--model", init, "--tokens", dump,
                           "--metrics", metrics, "--steps", str(n), "--dtype", dtype, "--batch", str(a.batch),
                           "--threads", str(a.threads), "--lr", str(a.lr), "--warmup", str(a.warmup)],
                          out + ".log", env)
        return rss, wall, steps_of(metrics)

    def tps(rows):
        return statistics.median(r["tokens_per_s"] for r in rows[1:]) if len(rows) > 1 else rows[0]["tokens_per_s"]

    for model in a.models.split(","):
        init, ids, cfg = prepare(model)
        fpt = flops_per_token(cfg, a.seq)
        for dtype in a.dtypes.split(","):
            n = int(steps.get(f"{model}.{dtype}", steps.get(model, 4)))
            pairs = []
            for p in range(a.pairs):
                rec = {}
                if a.smoke:
                    rss, wall, rows = run_oomless(f"{model}.{dtype}.oomless.{p}", init, ids, dtype, n, policy_of(model, dtype))
                    if len(rows) != n or not all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in rows):
                        sys.exit(f"run.py: {model} {dtype}: expected {n} steps with a finite loss, got {rows}")
                    print(f"{model} {dtype} (smoke): {n} steps, tok/s {tps(rows):.0f}, peak RSS {rss / 2**20:.0f} MiB, "
                          f"last loss {rows[-1]['loss']:.5f}", flush=True)
                    results["runs"].append({"model": model, "dtype": dtype, "pair": p, "system": "oomless", "rss": rss,
                                            "wall": wall, "tps": tps(rows), "losses": [r["loss"] for r in rows]})
                    continue
                for who in (["oomless", "torch"] if p % 2 == 0 else ["torch", "oomless"]):
                    tag = f"{model}.{dtype}.{who}.{p}"
                    if who == "oomless":
                        rss, wall, rows = run_oomless(tag, init, ids, dtype, n, policy_of(model, dtype))
                    else:
                        rss, wall, rows = run_torch(tag, init, dtype, n)
                    rec[who] = {"rss": rss, "wall": wall, "tps": tps(rows), "losses": [r["loss"] for r in rows]}
                    results["runs"].append({"model": model, "dtype": dtype, "pair": p, "system": who, **rec[who]})
                o, t = rec["oomless"], rec["torch"]
                print(f"{model} {dtype} pair {p}: tok/s {o['tps']:.0f} vs {t['tps']:.0f} ({o['tps'] / t['tps']:.2f}x); "
                      f"peak RSS {o['rss'] / 2**20:.0f} vs {t['rss'] / 2**20:.0f} MiB ({o['rss'] / t['rss']:.2f}x); "
                      f"last loss {o['losses'][-1]:.5f} vs {t['losses'][-1]:.5f}", flush=True)
                pairs.append(rec)
            if a.smoke:
                continue
            med = lambda f: statistics.median(f(r) for r in pairs)
            s = {"model": model, "dtype": dtype, "save_policy": policy_of(model, dtype), "steps": n, "pairs": len(pairs),
                 "oomless_tps": med(lambda r: r["oomless"]["tps"]), "torch_tps": med(lambda r: r["torch"]["tps"]),
                 "tps_ratio": med(lambda r: r["oomless"]["tps"] / r["torch"]["tps"]),
                 "oomless_rss": med(lambda r: r["oomless"]["rss"]), "torch_rss": med(lambda r: r["torch"]["rss"]),
                 "rss_ratio": med(lambda r: r["oomless"]["rss"] / r["torch"]["rss"]),
                 "flops_per_token": fpt}
            s["mfu_peak_gflops"] = peak_of.get(dtype, peak) / 1e9
            s["oomless_mfu"] = s["oomless_tps"] * fpt / peak_of.get(dtype, peak)
            s["torch_mfu"] = s["torch_tps"] * fpt / peak_of.get(dtype, peak)
            last = pairs[-1]
            s["last_loss_rel_diff"] = abs(last["oomless"]["losses"][-1] - last["torch"]["losses"][-1]) / abs(last["torch"]["losses"][-1])
            results["summary"].append(s)

    if a.curve_steps > 0 and "tiny" in a.models.split(","):
        init, ids, cfg = prepare("tiny")
        n = a.curve_steps
        _, _, orows = run_oomless("tiny.curve.oomless", init, ids, "fp32", n)
        _, _, trows = run_torch("tiny.curve.torch", init, "fp32", n)
        ol, tl = [r["loss"] for r in orows], [r["loss"] for r in trows]
        rel = [abs(x - y) / abs(y) for x, y in zip(ol, tl)]
        results["curve"] = {"steps": n, "oomless": ol, "torch": tl, "rel_diff_last": rel[-1],
                            "rel_diff_max_last20": max(rel[-20:]), "rel_diff_max": max(rel)}
        print(f"loss curves, tiny fp32, {n} steps: step {n} {ol[-1]:.5f} vs {tl[-1]:.5f} (relative {rel[-1]:.2e}); "
              f"largest relative difference over the last 20 steps {max(rel[-20:]):.2e}, over all {max(rel):.2e}", flush=True)

    path = a.json or os.path.join(a.work, "results.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    if a.smoke:
        print(f"\nresults: {path}")
        return
    print("\n| model | dtype | oomless --save-policy | oomless tok/s | PyTorch tok/s | ratio | oomless peak RSS | PyTorch peak RSS | ratio | MFU oomless / PyTorch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in results["summary"]:
        print(f"| {s['model']} | {s['dtype']} | {s.get('save_policy', 'all')} | {s['oomless_tps']:.0f} | {s['torch_tps']:.0f} | {s['tps_ratio']:.2f}x | "
              f"{s['oomless_rss'] / 2**20:.0f} MiB | {s['torch_rss'] / 2**20:.0f} MiB | {s['rss_ratio']:.2f}x | "
              f"{100 * s['oomless_mfu']:.1f}% / {100 * s['torch_mfu']:.1f}% |")
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
