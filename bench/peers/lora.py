"""LoRA fine-tuning side by side: `oomless train --lora R` and PEFT + transformers (bench/peers/train_torch.py
--lora R) on SmolLM2-135M-Instruct (its Q4_1 GGUF dequantised to an f32 Hugging Face folder by `oomless
convert`, so both train the same base), the same token stream (oomless's --dump-tokens), all-linear, alpha
2R, AdamW, at --seq T. Per configuration (--configs: lora or qlora, fp32 or bf16 compute; qlora is
`oomless train --qlora` against bitsandbytes 4-bit nf4 with double quantisation + PEFT), --pairs runs of
each system in alternating order: tokens/s (median over the steps after the first) and peak RSS
(/usr/bin/time -v); ratios are medians over the pairs.

usage: tools/golden/.venv/bin/python bench/peers/lora.py [--gguf PATH] [--seq 1024] [--pairs 3]
       [--configs lora:fp32,lora:bf16,qlora:fp32,qlora:bf16]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import ROOT, sh, steps_of, timed  # noqa: E402


def smollm2_hf(oomless, work, gguf=None):
    """SmolLM2-135M-Instruct as an f32 Hugging Face folder (its Q4_1 GGUF through `oomless convert`) and the
    bundled corpus tokenized for it, made once under `work`: (folder, ids file)."""
    gguf = gguf or sh([os.path.join(ROOT, "scripts/fetch_smollm2.sh")]).stdout.strip().splitlines()[-1]
    init = os.path.join(work, "smollm2-135m-hf")
    if not os.path.exists(os.path.join(init, "model.safetensors")):
        sh([oomless, "convert", "--model", gguf, "--out", init])
    ids = os.path.join(work, "smollm2.ids")
    if not os.path.exists(ids):
        out = sh([oomless, "tokenize", "--model", init, "--text-file", os.path.join(ROOT, "data/kjv/train.txt"),
                  "--no-special"]).stdout
        with open(ids, "w") as f:
            f.write(out)
    return init, ids


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--oomless", default=os.path.join(ROOT, "build/release/oomless"))
    ap.add_argument("--python", default=os.path.join(ROOT, "tools/golden/.venv/bin/python"))
    ap.add_argument("--work", default=os.path.join(ROOT, "build/peers-lora"))
    ap.add_argument("--gguf", default=None, help="SmolLM2-135M-Instruct Q4_1 GGUF (default: scripts/fetch_smollm2.sh)")
    ap.add_argument("--configs", default="lora:fp32,lora:bf16,qlora:fp32,qlora:bf16",
                    help="comma-separated METHOD:DTYPE, METHOD lora or qlora, DTYPE fp32 or bf16")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    init, ids = smollm2_hf(a.oomless, a.work, a.gguf)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), TOKENIZERS_PARALLELISM="false")
    probe = json.loads(sh([a.oomless, "probe", "--json", "--quick", "--threads", str(a.threads)]).stdout)
    print(f"machine: {probe['cpu']} ({probe['isa']}), {a.threads} threads", flush=True)
    # train_torch.py's min-lr and weight decay, given explicitly (oomless's defaults depend on the model).
    common = ["--seq", str(a.seq), "--batch", "1", "--lr", "1e-4", "--warmup", "1", "--min-lr", "1e-4",
              "--weight-decay", "0.1"]
    results = {"probe": probe, "seq": a.seq, "rank": a.rank, "steps": a.steps, "runs": [], "summary": []}

    def tps(rows):
        return statistics.median(r["tokens_per_s"] for r in rows[1:]) if len(rows) > 1 else rows[0]["tokens_per_s"]

    for conf in a.configs.split(","):
        method, dtype = conf.split(":")
        assert method in ("lora", "qlora") and dtype in ("fp32", "bf16"), conf
        quant = ["--qlora"] if method == "qlora" else []
        pairs = []
        for p in range(a.pairs):
            rec = {}
            for who in (["oomless", "peft"] if p % 2 == 0 else ["peft", "oomless"]):
                out = os.path.join(a.work, "runs", f"{method}-{dtype}.{who}.{p}")
                subprocess.run(["rm", "-rf", out])
                os.makedirs(os.path.dirname(out), exist_ok=True)
                dump = os.path.join(a.work, f"dump-{a.steps}.jsonl")
                if who == "oomless":
                    rss, wall = timed([a.oomless, "train", "--model", init, "--data", ids, "--steps", str(a.steps),
                                       "--dtype", dtype, "--threads", str(a.threads), "--eval-every", "0",
                                       "--save-every", "0", "--out", out, "--lora", str(a.rank),
                                       "--dump-tokens", dump + ".part"] + quant + common, out + ".log", env)
                    os.replace(dump + ".part", dump)
                    rows = steps_of(os.path.join(out, "metrics.jsonl"))
                else:
                    rss, wall = timed([a.python, os.path.join(HERE, "train_torch.py"), "--model", init, "--tokens",
                                       dump, "--metrics", out + ".jsonl", "--steps", str(a.steps), "--dtype", dtype,
                                       "--threads", str(a.threads), "--lr", "1e-4", "--warmup", "1", "--lora",
                                       str(a.rank)] + quant, out + ".log", env)
                    rows = steps_of(out + ".jsonl")
                rec[who] = {"rss": rss, "wall": wall, "tps": tps(rows), "losses": [r["loss"] for r in rows]}
                results["runs"].append({"config": conf, "pair": p, "system": who, **rec[who]})
            o, t = rec["oomless"], rec["peft"]
            print(f"{conf} pair {p}: tok/s {o['tps']:.0f} vs {t['tps']:.0f} ({o['tps'] / t['tps']:.2f}x); peak RSS "
                  f"{o['rss'] / 2**20:.0f} vs {t['rss'] / 2**20:.0f} MiB ({o['rss'] / t['rss']:.2f}x); losses "
                  f"{o['losses'][0]:.4f}->{o['losses'][-1]:.4f} vs {t['losses'][0]:.4f}->{t['losses'][-1]:.4f}", flush=True)
            pairs.append(rec)
        med = lambda f: statistics.median(f(r) for r in pairs)
        results["summary"].append({"config": conf, "oomless_tps": med(lambda r: r["oomless"]["tps"]),
                                   "peft_tps": med(lambda r: r["peft"]["tps"]),
                                   "tps_ratio": med(lambda r: r["oomless"]["tps"] / r["peft"]["tps"]),
                                   "oomless_rss": med(lambda r: r["oomless"]["rss"]), "peft_rss": med(lambda r: r["peft"]["rss"]),
                                   "rss_ratio": med(lambda r: r["oomless"]["rss"] / r["peft"]["rss"])})
    path = a.json or os.path.join(a.work, "results.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n| method:dtype | oomless tok/s | PEFT tok/s | ratio | oomless peak RSS | PEFT peak RSS | ratio |\n|---|---|---|---|---|---|---|")
    for s in results["summary"]:
        print(f"| {s['config']} | {s['oomless_tps']:.0f} | {s['peft_tps']:.0f} | {s['tps_ratio']:.2f}x | "
              f"{s['oomless_rss'] / 2**20:.0f} MiB | {s['peft_rss'] / 2**20:.0f} MiB | {s['rss_ratio']:.2f}x |")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
