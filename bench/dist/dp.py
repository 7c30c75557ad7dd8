"""Data parallel (and context parallel) on one machine: `mpirun -np N oomless train` for N in --ranks.

For each N: the median tokens/s of the steps after the first (the whole step's tokens over its time, so the
ranks' work together), each rank's ledger peak (metrics.jsonl "ranks") and peak RSS (/usr/bin/time -v around
each rank), and the bytes each rank sent per step (bytes_sent between two steps) against the formula of a
ring all-reduce of the gradients, 2 (N - 1) / N x 4 bytes x trainable parameters (the ZeRO paper's 2 Psi for
data parallel), plus the few small collectives of a step (--zero 3: 3 Psi; with '--lora' in --train-flags, the
adapters' 2 Psi and the frozen base's layers, m (2L - 2h) layer gathers a step for m sequences a rank and h
gathered layers, 2 unless '--zero-prefetch no'; with --dtype bf16 the projection matrices travel in bf16).
Threads: the machine's CPUs shared by the ranks
(--threads-per-rank, default CPUs / N), so on a 2-core machine N = 2 runs one thread a rank and N > 2
oversubscribes: step time vs N measures the sum's cost there, not scaling.

--context-parallel: the N > 1 runs spread each sequence over the ranks (--context-parallel N) instead of sharing
out the batch; a rank's bytes a step are then the gradients' sum plus, per layer, its keys and values sent to
the later ranks twice (forward, backward) and the earlier slices' key gradients sent back: rank r sends
2 (N - 1 - r) + r blocks of 2 x Hkv x (seq / N) x D floats a layer; with --train-flags '--cp-split zigzag', in
half blocks, 2 ((N - 1 - r) + 2 r) + r + 2 (N - 1 - r) (with '--sparse-pages', the selection decides: the formula
column is then the gradients' sum alone). --fit SIZE: for each N, the longest --seq
(a multiple of 256 N) whose `oomless estimate --ranks N [--context-parallel N]` fits SIZE a rank, then a run at
that --seq (its ledger peak and RSS against SIZE). --links: context parallel over simulated links
(OOMLESS_DIST_LINK=LATENCY_US,GB_PER_S: a rank's receives cross one inbound link of that bandwidth in post
order, each then delayed by the latency), the tokens/s each gives against the plain transport: where the link's time stops hiding behind
the attention that overlaps it; with --zero 3 instead, each link with the next layer's weights sent while one
computes (--zero-prefetch yes), or as many layers ahead as --prefetch lists (e.g. 'yes,3,no'), and without.

usage: python3 bench/dist/dp.py [--oomless build/release/oomless] [--model preset:tiny] [--ranks 1,2,4]
                                [--seq 256] [--batch 4] [--steps 4] [--rounds 2] [--zero 0-3] [--work build/bench-dp] [--smoke]
                                [--context-parallel] [--fit SIZE] [--dtype fp32|bf16] [--links 'none;50,1.25']
                                [--train-flags 'FLAGS'] [--prefetch yes,3,no]
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def cp_flags(a, n):
    return ["--context-parallel", str(n)] if a.context_parallel and n > 1 else []


def fits(a, n, seq):
    """Whether `oomless estimate` puts a rank of N under a.fit at --seq seq."""
    cmd = [a.oomless, "estimate", "--model", a.model, "--seq", str(seq), "--batch", str(a.batch), "--ranks", str(n),
           "--zero", str(a.zero), "--dtype", a.dtype, "--budget", a.fit, "--json"] + cp_flags(a, n)
    p = subprocess.run(cmd, capture_output=True, text=True)  # exits 3 where it does not fit
    try:
        return json.loads(p.stdout)["fits"]
    except (ValueError, KeyError):
        sys.exit(f"dp.py: {' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-2000:]}")


def longest(a, n):
    step = 256 * n
    lo, hi = 0, step
    while fits(a, n, hi):
        lo, hi = hi, 2 * hi
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(a, n, mid) else (lo, mid)
    return lo


def formula_bytes(a):
    """Bytes a parameter sends a step over the ZeRO paper's (N - 1) / N: the gradients' sum (twice, reduce-scatter
    and all-gather, under data parallel; once to the owners under ZeRO) in fp32 or, with --grad-sum-dtype bf16, in
    bf16, then under ZeRO the new weights from their owners (and under stage 3 the layers gathered twice)."""
    g = 2 if "--grad-sum-dtype bf16" in a.train_flags else 4
    if a.zero == 0:
        return 2 * g
    return g + (4 if a.zero < 3 else 8)


def run(a, n, tag, link=None):
    out = os.path.join(a.work, tag)
    shutil.rmtree(out, ignore_errors=True)
    threads = a.threads_per_rank or max(1, (os.cpu_count() or 1) // n)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    env.pop("OOMLESS_DIST_LINK", None)
    if link:
        env["OOMLESS_DIST_LINK"] = link
    # --bind-to none: OpenMPI binds each of 1-2 ranks to one core, which would leave a rank's second thread none.
    cmd = ["mpirun", "-np", str(n), "--bind-to", "none", "/usr/bin/time", "-v", a.oomless, "train", "--model", a.model, "--seq", str(a.seq),
           "--batch", str(a.batch), "--steps", str(a.steps), "--threads", str(threads), "--eval-every", "0",
           "--save-every", "0", "--zero", str(a.zero), "--dtype", a.dtype, "--out", out] + cp_flags(a, n) + \
        a.train_flags.split()
    if a.data:
        cmd[cmd.index("--seq"):cmd.index("--seq")] = ["--data", a.data]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"dp.py: {' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    rss = [int(x) * 1024 for x in re.findall(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)]
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"train"' in l]
    tps = statistics.median(r["tokens_per_s"] for r in rows[1:]) if len(rows) > 1 else rows[0]["tokens_per_s"]
    params = rows[0]["params"]["trainable"]
    ranks = rows[-1].get("ranks")
    # Device + Host (memory), as each rank's "peak" in metrics.jsonl; a disk tier (spilled state) is not memory
    peaks = ranks["peak"] if ranks else [sum(rows[-1]["memory"][t]["total"]["peak"] for t in rows[-1]["memory"]
                                             if t != "disk")]
    optim = ranks["optimizer"] if ranks else [sum(rows[-1]["memory"][t].get("optimizer", {}).get("peak", 0)
                                                  for t in rows[-1]["memory"])]
    weights = ranks["weights"] if ranks else [sum(rows[-1]["memory"][t].get("weights", {}).get("peak", 0)
                                                  for t in rows[-1]["memory"])]
    sent_all = [x - y for x, y in zip(ranks["bytes_sent"], rows[-2]["ranks"]["bytes_sent"])] \
        if ranks and len(rows) > 1 else [0]
    sent = sent_all[0]
    # --zero 3: the layers' weights gathered before each forward and each backward besides the gradients' sum:
    # the ZeRO paper's 3 Psi (its mean over the ranks; who sends depends on who owns what).
    # --grad-sum-dtype bf16: the sums' share in 2-byte halves (the all-reduce's both halves under --zero 0).
    formula = [(n - 1) / n * params * formula_bytes(a)] * n
    if a.zero >= 3 and "--lora" in a.train_flags and n > 1:
        # An adapter run: the adapters' sum (2 Psi_adapters), and the frozen base's layers gathered for every sequence
        # a rank runs, each layer before its forward and its backward but those a pass turns on (a frozen layer stays
        # valid between sequences and steps): m (2L - 2) layers of Psi_layers / L with one gathered layer
        # (--zero-prefetch no), m (2L - 4) with two (the default: two layers held at each turn).
        shape = json.loads(subprocess.run([a.oomless, "estimate", "--model", a.model, "--seq", str(a.seq), "--json"],
                                          capture_output=True, text=True).stdout)["shape"]
        m, L = a.batch // n, shape["layers"]
        held = 1 if "--zero-prefetch no" in a.train_flags else 2
        # A layer's bytes: 4 a parameter, but 2 for the projection matrices under bf16 compute (sent as the
        # products read them).
        mats = shape["layer_matrix_parameters"] / L if a.dtype == "bf16" else 0
        layer = 4 * (shape["layer_parameters"] / L - mats) + 2 * mats
        formula = [(n - 1) / n * (4 * 2 * params + m * (2 * L - 2 * held) * layer)] * n
    if cp_flags(a, n):  # the keys, values and key gradients of each layer (the model's config in the checkpoint)
        cfg = json.load(open(os.path.join(out, sorted(d for d in os.listdir(out) if d.startswith("checkpoint-"))[-1],
                                          "config.json")))
        L, Hkv = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
        D = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        block = 2 * Hkv * (a.seq // n) * D * 4
        if "zigzag" in a.train_flags:  # half blocks: the first piece to each later rank and both to each earlier one
            # (twice), the gradients back for an earlier rank's first piece and a later rank's two
            formula = [f + a.batch * L * block / 2 * (2 * ((n - 1 - r) + 2 * r) + (r + 2 * (n - 1 - r)))
                       for r, f in enumerate(formula)]
        elif "--sparse-pages" not in a.train_flags:
            formula = [f + a.batch * L * block * (2 * (n - 1 - r) + r) for r, f in enumerate(formula)]
    shutil.rmtree(out, ignore_errors=True)
    return {"ranks": n, "threads_per_rank": threads, "tokens_per_s": tps, "ledger_peak": peaks, "optimizer": optim,
            "weights": weights,
            "rss": sorted(rss), "bytes_sent_per_step": sent, "bytes_sent_per_step_ranks": sent_all,
            "formula_bytes": formula[0], "formula_bytes_ranks": formula, "params": params,
            "losses": [r["loss"] for r in rows]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--oomless", default=os.path.join(ROOT, "build/release/oomless"))
    ap.add_argument("--model", default="preset:tiny")
    ap.add_argument("--data", default=None)
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2, help="the N values alternate, this many times")
    ap.add_argument("--threads-per-rank", type=int, default=0)
    ap.add_argument("--zero", type=int, default=0, help="ZeRO stage (--zero of oomless train): 0-3")
    ap.add_argument("--work", default=os.path.join(ROOT, "build/bench-dp"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="preset:micro, --seq 32, 2 steps, ranks 1,2, one round")
    ap.add_argument("--context-parallel", action="store_true", help="N > 1: each sequence spread over the ranks")
    ap.add_argument("--fit", default=None, help="a rank's budget: the longest --seq that fits, for each N")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--train-flags", default="", help="more flags for oomless train, e.g. '--optim-state disk "
                    "--spill-dir DIR --save-optimizer no'")
    ap.add_argument("--links", default=None,
                    help="with --context-parallel or --zero 3: simulated links to compare, ';'-separated "
                         "LATENCY_US,GB_PER_S (OOMLESS_DIST_LINK), 'none' for the plain transport (--zero 3: each "
                         "with each --prefetch)")
    ap.add_argument("--prefetch", default="yes,no",
                    help="with --zero 3 --links: the --zero-prefetch settings to compare (yes, 2, 3, no; no is "
                         "always run)")
    a = ap.parse_args()
    if a.smoke:
        a.model, a.seq, a.steps, a.ranks, a.rounds, a.batch = "preset:micro", 32, 2, "1,2", 1, 2
    if not shutil.which("mpirun"):
        sys.exit("dp.py: no mpirun (scripts/setup.sh installs openmpi-bin)")
    os.makedirs(a.work, exist_ok=True)
    ns = [int(x) for x in a.ranks.split(",")]
    if a.fit:
        return fit(a, ns)
    if a.links:
        return links(a, ns)
    res = {n: [] for n in ns}
    for r in range(a.rounds):
        for n in ns:
            res[n].append(run(a, n, f"n{n}"))
    print(f"{a.model}, --seq {a.seq} --batch {a.batch} (global), {a.steps} steps, {a.rounds} round(s); "
          f"{os.cpu_count()} CPUs")
    print(f"--zero {a.zero}" + (", --context-parallel N" if a.context_parallel else ""))
    g = 2 if "--grad-sum-dtype bf16" in a.train_flags else 4
    k = (f"{3 if a.zero >= 3 else 2}(N-1)/N x 4 B" if g == 4 else
         f"(N-1)/N x ({'2 x 2' if a.zero == 0 else '2 + 4' if a.zero < 3 else '2 + 2 x 4'} B)")
    print("| ranks | threads a rank | tok/s (median of rounds) | vs 1 rank | ledger peak a rank (largest) | optimizer "
          f"state a rank (largest) | weights a rank (largest) | peak RSS a rank | sent a step, rank 0 / mean of ranks | " +
          ("formula (N-1)/N x 4 B x (2 Psi_adapters + m (2L-2h) Psi_layer), h layers held |"
           if a.zero >= 3 and "--lora" in a.train_flags else f"formula {k} x params |"))
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = statistics.median(x["tokens_per_s"] for x in res[ns[0]])
    summary = []
    for n in ns:
        xs = res[n]
        tps = statistics.median(x["tokens_per_s"] for x in xs)
        peak = max(max(x["ledger_peak"]) for x in xs)
        rss = max(max(x["rss"]) for x in xs) if all(x["rss"] for x in xs) else 0
        sent = xs[-1]["bytes_sent_per_step"]
        mean = statistics.mean(xs[-1]["bytes_sent_per_step_ranks"])
        opt = max(max(x["optimizer"]) for x in xs)
        wts = max(max(x["weights"]) for x in xs)
        print(f"| {n} | {xs[0]['threads_per_rank']} | {tps:.0f} | {tps / base:.2f}x | {peak / 2**20:.1f} MiB | "
              f"{opt / 2**20:.1f} MiB | {wts / 2**20:.1f} MiB | {rss / 2**20:.1f} MiB | {sent / 2**20:.2f} / "
              f"{mean / 2**20:.2f} MiB | {xs[0]['formula_bytes'] / 2**20:.2f} MiB |")
        if a.context_parallel and n > 1:
            print("|  | each rank: sent / formula | " + ", ".join(
                f"{s / 2**20:.2f} / {f / 2**20:.2f} MiB" for s, f in
                zip(xs[-1]["bytes_sent_per_step_ranks"], xs[-1]["formula_bytes_ranks"])) + " |||||||")
        summary.append({"ranks": n, "tokens_per_s": tps, "ledger_peak": peak, "optimizer": opt, "weights": wts,
                        "rss": rss, "bytes_sent_per_step": sent, "bytes_sent_per_step_mean": mean,
                        "formula_bytes": xs[0]["formula_bytes"], "runs": xs})
    # The same global batch: the 1-rank losses within fp32 rounding (bf16 compute: the gradients' sums, rounded
    # otherwise, move the weights the products read in bf16, so within bf16's).
    # bf16 compute, or gradients summed in bf16 (each rank's rounded): the runs agree to bf16 rounding
    tol = 1e-3 if a.dtype == "bf16" or "--grad-sum-dtype bf16" in a.train_flags else 1e-5
    for n in ns[1:]:
        a0, b0 = res[ns[0]][0]["losses"], res[n][0]["losses"]
        worst = max(abs(x - y) / abs(x) for x, y in zip(a0, b0))
        print(f"{n} ranks: losses within {worst:.1e} (relative) of {ns[0]} rank(s)'")
        if worst > tol:
            sys.exit(f"dp.py: {n} ranks' losses {b0} differ from {a0}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "seq": a.seq, "batch": a.batch, "steps": a.steps, "zero": a.zero,
                       "train_flags": a.train_flags,
                       "summary": summary}, f, indent=1)


def zero3_links(a, ns, ls):
    """--zero 3 over simulated links (the layers' sends delayed; the gradients' sums, collectives, are not), with the
    next layer sent while one computes (--zero-prefetch yes) and without: tokens/s, the settings alternating."""
    print(f"{a.model} --dtype {a.dtype}, --seq {a.seq} --batch {a.batch}, --zero 3, {a.steps} steps, {a.rounds} "
          f"round(s); {os.cpu_count()} CPUs")
    print("| ranks | link (latency, bandwidth) | --zero-prefetch | tok/s (median of rounds) | vs no link | vs no "
          "prefetch | sent a step, rank 0 |")
    print("|---|---|---|---|---|---|---|")
    flags, out = a.train_flags, []
    pfs = [x.strip() for x in a.prefetch.split(",")]
    if "no" not in pfs:
        pfs.append("no")  # the "vs no prefetch" column's
    for n in ns:
        res = {(x, pf): [] for x in ls for pf in pfs}
        for _ in range(a.rounds):
            for x, pf in res:
                a.train_flags = f"{flags} --zero-prefetch {pf}"
                res[(x, pf)].append(run(a, n, f"link{n}", None if x == "none" else x))
        a.train_flags = flags
        tps = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in res.items()}
        for (x, pf), v in res.items():
            name = "none (shared memory)" if x == "none" else f"{x.split(',')[0]} us, {x.split(',')[1]} GB/s"
            print(f"| {n} | {name} | {pf} | {tps[(x, pf)]:.0f} | {tps[(x, pf)] / tps[(ls[0], pf)]:.2f}x | "
                  f"{tps[(x, pf)] / tps[(x, 'no')]:.2f}x | {v[-1]['bytes_sent_per_step'] / 2**20:.2f} MiB |")
            out.append({"ranks": n, "link": x, "zero_prefetch": pf, "tokens_per_s": tps[(x, pf)], "runs": v})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "seq": a.seq, "runs": out}, f, indent=1)


def links(a, ns):
    """Context parallel over simulated links: tokens/s against the plain transport, the links alternating."""
    ls = [x.strip() for x in a.links.split(";")]
    if a.zero >= 3 and not a.context_parallel:
        return zero3_links(a, ns, ls)
    print(f"{a.model} --dtype {a.dtype}, --seq {a.seq} --batch {a.batch}, --context-parallel N, {a.steps} steps, "
          f"{a.rounds} round(s); {os.cpu_count()} CPUs")
    print("| ranks | link (latency, bandwidth) | tok/s (median of rounds) | vs no link | ring bytes a step, rank 0 | "
          "their time on the link alone |")
    print("|---|---|---|---|---|---|")
    out = []
    for n in ns:
        res = {x: [] for x in ls}
        for _ in range(a.rounds):
            for x in ls:
                res[x].append(run(a, n, f"link{n}", None if x == "none" else x))
        base = statistics.median(r["tokens_per_s"] for r in res[ls[0]])
        for x in ls:
            tps = statistics.median(r["tokens_per_s"] for r in res[x])
            r0 = res[x][-1]  # rank 0's ring traffic: what it sent less the gradients' sum (not on the link)
            sent = r0["bytes_sent_per_step"] - 2 * (n - 1) / n * 4 * r0["params"]
            if x == "none":
                wire = "-"
            else:
                us, gbs = (float(v) for v in x.split(","))
                wire = f"{sent / (gbs * 1e9) * 1e3:.1f} ms + latency"
            name = "none (shared memory)" if x == "none" else f"{x.split(',')[0]} us, {x.split(',')[1]} GB/s"
            print(f"| {n} | {name} | {tps:.0f} | {tps / base:.2f}x | {sent / 2**20:.2f} MiB | {wire} |")
            out.append({"ranks": n, "link": x, "tokens_per_s": tps, "runs": res[x]})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "seq": a.seq, "runs": out}, f, indent=1)


def fit(a, ns):
    """For each N, the longest --seq under a.fit a rank by the estimate, then a run of it."""
    print(f"{a.model} --dtype {a.dtype}, --batch {a.batch}, a rank's budget {a.fit}" +
          (", --context-parallel N" if a.context_parallel else "") + f"; {os.cpu_count()} CPUs")
    print("| ranks | longest --seq that fits | vs 1 rank | ledger peak a rank (largest) | peak RSS a rank | tok/s |")
    print("|---|---|---|---|---|---|")
    out = []
    for n in ns:
        a.seq = longest(a, n)
        x = run(a, n, f"fit{n}")
        out.append(x | {"seq": a.seq})
        print(f"| {n} | {a.seq} | {a.seq / out[0]['seq']:.2f}x | {max(x['ledger_peak']) / 2**20:.1f} MiB | "
              f"{max(x['rss']) / 2**20:.1f} MiB | {x['tokens_per_s']:.0f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "budget": a.fit, "runs": out}, f, indent=1)


if __name__ == "__main__":
    main()
