"""Long context: peak memory and time of one training step against the sequence length T.

Systems: chunk-recurrent `oomless train` (--chunk C; the keys and values of earlier chunks on the device,
in host memory or on disk: --kv-offload none, host, disk), full-sequence `oomless train` (fused chunked
cross-entropy, no logits tensor) and PyTorch + transformers (bench/long_context/train_torch_long.py:
gradient checkpointing, HF's loss over the whole logits).

For each model (a preset written once with `oomless convert --seed 0`, so every system starts from the
same safetensors; the bundled KJV text as .ids) T doubles: from --full-t-min for PyTorch and full-sequence
oomless, from --t-min for chunk-recurrent oomless (the disk mode from --disk-t-min, one chunk, so that its
memory slope has two measured T's even where only --t-min fits the time box). oomless runs with
--save-policy none by default (--chunk-save-policy, --full-save-policy: keep each block's input, recompute
the block in backward), as PyTorch's gradient checkpointing does: with all, one 4096-token chunk of
smollm2-135m alone holds ~3.9 GiB of activations, nearly the whole 4 GiB budget.
Every run is one optimizer step of one sequence (batch 1, fp32, 2 threads) in a fresh process, measured:
  - peak RSS of the whole process (/usr/bin/time -v);
  - a memory cgroup made for the run (v1 memory.limit_in_bytes / max_usage_in_bytes, or v2 memory.max /
    memory.peak; limit --cgroup-limit): its high-water mark counts page cache first touched by the run
    (the final checkpoint, the spill file) but not pages already cached (shared libraries), and its
    anonymous memory (memory.stat rss / anon) is sampled every 0.2 s;
  - oomless's own ledger (OUT/metrics.jsonl): Device + Host peak, Disk peak;
  - step time: the step's own wall time (oomless: T / tokens_per_s of the step; PyTorch: forward +
    backward + optimizer step), without process start, loading and oomless's final checkpoint;
  - oomless's `kv offload (...)` line: K/V bytes each way and the time compute waited on them (the wait
    column is that time over the run's training time).

Time box: before each run its step time is predicted from the measured runs before it in the same series
(least squares of step(T) = a T + b T^2, a, b >= 0; a chunk-recurrent series with points at under two T's
takes those of all the model's chunk-recurrent modes; points at one T only: b / a from the model's FLOPs,
attention at half the GEMM rate). A run predicted over its --time-box, or that would end (prediction + 20%
+ the largest start/load/save time seen) after its model's share of --deadline (each model gets an equal
share of what is left when it starts), is not run: its row is "extrapolated" with the fit's coefficients,
and PyTorch and full-sequence series stop there. They also stop after the first T whose peak RSS exceeds
--budget. Memory is not extrapolated per row: the disk mode's ledger is flat by design, so its slope
(least squares of Device + Host peak against T, MB per 1K tokens) is reported instead.

Floors: disk step time <= 1.10x the none mode's at every T both measured (median of --repeats); disk
slope <= 0.5 MB per 1K tokens; on smollm2-135m, the longest T disk-offload oomless trains with peak RSS
<= --budget B (default 4 GiB) >= 8x PyTorch's, measured (a lower bound when the time box, not B, ended the
disk series) and estimated (PyTorch: RSS linear in T through its last two points; disk: the RSS slope).
The split of that gain: full-sequence oomless (fused cross-entropy + recompute) against PyTorch, and
chunk-recurrent against full-sequence oomless.

usage: bench/long_context/run.py [--oomless build/release/oomless] [--work build/long] [--models tiny,smollm2-135m]
       [--modes none,disk,host] [--t-min 8192] [--t-max 131072] [--chunk 4096] [--page 64]
       [--time-box 150,smollm2-135m=300] [--deadline 2520] [--budget 4GiB] [--no-torch] ...
Writes bench/long_context/results/DATE.json and docs/long_context_memory.svg (peak memory against T, drawn
here, no plotting library) and prints a markdown table, the floors and the budget comparison.
Needs tools/golden/.venv for the PyTorch side (bench/peers/setup.sh creates it).
--smoke (`make test-smoke`): the oomless side only (no PyTorch, no venv), preset:micro at T = 256 and 512 with
chunk 128, page 32, every mode; results and plot go to WORK/smoke.json and WORK/smoke.svg, and any run that is
not measured fails the invocation. It checks the harness and the commands it drives, not figures.
"""
import argparse
import datetime
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CHUNKED = ("none", "host", "disk")
FLOOR_MODEL = "smollm2-135m"  # the model of the longest-T-under-budget floor
UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
MiB = 2**20


def parse_size(s):
    """'4GiB', '54.00 MiB', '512 B', '1e9' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", s)
    if not m or (m.group(2) and m.group(2).upper() not in UNITS):
        raise ValueError(f"not a size: {s!r}")
    return int(float(m.group(1)) * UNITS[m.group(2).upper() or "B"])


def mib(x):
    return "-" if x is None else f"{x / MiB:.0f} MiB"


def sh(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"run.py: {' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return r


# ---------------------------------------------------------------------------------------------------------
# Memory cgroups: a child group per run, with a limit; its high-water mark read after the run.

class Cgroup:
    """cgroup v1 (memory controller) or v2, whichever lets this process make a child group that works.
    peak: the group's high-water mark, page cache charged to the run included (files it writes: the final
    checkpoint, the spill file; not pages other processes had already cached, such as shared libraries).
    anon: its anonymous memory, sampled every POLL seconds while the run lasts (the largest sample)."""

    V1 = {"limit": "memory.limit_in_bytes", "peak": "memory.max_usage_in_bytes", "anon": "rss"}
    V2 = {"limit": "memory.max", "peak": "memory.peak", "anon": "anon"}
    POLL = 0.2

    def __init__(self, limit):
        self.limit, self.parent, self.files, self.why, self.n = limit, None, None, "", 0
        for parent, files in self.candidates():
            try:
                self.parent, self.files = parent, files
                self.check()
                return
            except (OSError, ValueError, subprocess.CalledProcessError) as e:
                self.why += f"{parent}: {e}; "
        self.parent = None

    @staticmethod
    def candidates():
        own = {}
        for line in open("/proc/self/cgroup"):
            _, ctrl, path = line.rstrip("\n").split(":", 2)
            for c in ctrl.split(","):
                own[c] = path
        if os.path.isdir("/sys/fs/cgroup/memory") and "memory" in own:
            yield "/sys/fs/cgroup/memory" + own["memory"].rstrip("/"), Cgroup.V1
        for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
            if os.path.exists(os.path.join(root, "cgroup.controllers")) and "" in own:
                yield root + own[""].rstrip("/"), Cgroup.V2

    def check(self):
        """A trial run of `true` in a child group: the group, its limit and its figures must all work."""
        g = self.make()
        try:
            subprocess.run(self.wrap(g, ["true"]), check=True)
            self.peak(g), self.anon(g)
        finally:
            self.remove(g)

    def make(self):
        self.n += 1
        g = os.path.join(self.parent, f"oomless-long-{os.getpid()}-{self.n}")
        os.mkdir(g)
        try:
            with open(os.path.join(g, self.files["limit"]), "w") as f:
                f.write(str(self.limit))
        except OSError:
            self.remove(g)
            raise
        return g

    @staticmethod
    def wrap(g, cmd):
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', g] + cmd

    def peak(self, g):
        return int(open(os.path.join(g, self.files["peak"])).read())

    def anon(self, g):
        for line in open(os.path.join(g, "memory.stat")):
            k, v = line.split()
            if k == self.files["anon"]:
                return int(v)
        raise ValueError(f"no {self.files['anon']} in {g}/memory.stat")

    @staticmethod
    def remove(g):
        for _ in range(50):
            try:
                os.rmdir(g)
                return
            except OSError:
                time.sleep(0.1)
        print(f"run.py: could not remove cgroup {g}", file=sys.stderr)

    def describe(self):
        if self.parent is None:
            return f"no memory cgroup could be used ({self.why.strip('; ')}); cgroup columns left empty"
        kind = "v1" if self.files is Cgroup.V1 else "v2"
        return f"memory cgroup {kind} under {self.parent}, limit {self.limit / 2**30:.1f} GiB per run"


def wait_sampling(p, timeout, sample):
    """Waits for p, calling sample() every Cgroup.POLL seconds; after timeout seconds, or when this script
    is interrupted, kills p's process group (SIGKILL: oomless finishes its step on SIGTERM).
    Returns (exit status, timed out)."""
    end = time.perf_counter() + timeout
    try:
        while time.perf_counter() < end:
            try:
                return p.wait(timeout=Cgroup.POLL), False
            except subprocess.TimeoutExpired:
                sample()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return p.wait(), True


def measure(cmd, log, env, cgroup, timeout):
    """Runs cmd under /usr/bin/time -v (inside a fresh cgroup when there is one), in its own process group.
    Returns {rc, rss, wall, cgroup_max, cgroup_anon, timed_out, text}."""
    g = cgroup.make() if cgroup.parent else None
    full = ["/usr/bin/time", "-v"] + cmd
    anon = [0]
    sample = (lambda: anon.__setitem__(0, max(anon[0], cgroup.anon(g)))) if g else (lambda: None)
    t0 = time.perf_counter()
    try:
        with open(log, "w") as f:
            p = subprocess.Popen(Cgroup.wrap(g, full) if g else full, stdout=f, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True)
            rc, timed_out = wait_sampling(p, timeout, sample)
        wall = time.perf_counter() - t0
        cg = cgroup.peak(g) if g else None
    finally:
        if g:
            cgroup.remove(g)
    text = open(log, errors="replace").read()
    rss = [line for line in text.splitlines() if "Maximum resident set size" in line]
    return {"rc": rc, "rss": int(rss[-1].split(":")[1]) * 1024 if rss else None, "wall": wall, "cgroup_max": cg,
            "cgroup_anon": anon[0] if g else None, "timed_out": timed_out, "text": text}


# ---------------------------------------------------------------------------------------------------------
# Step-time law: step(T) = a T + b T^2, a, b >= 0, least squares.

def fit_step(points, shape):
    """points: [(T, seconds)] -> {a, b, n}, or None without points. Points at one T only: b / a = shape."""
    pts = sorted(points)
    if not pts:
        return None
    if len({t for t, _ in pts}) == 1:
        t, s = pts[-1]
        a = s / (t + shape * t**2)
        return {"a": a, "b": shape * a, "n": len(pts), "note": f" at one T; b/a {shape:.3g} from FLOPs"}
    sxx = sum(t**2 for t, _ in pts)
    sxy = sum(t**3 for t, _ in pts)
    syy = sum(t**4 for t, _ in pts)
    bx = sum(t * s for t, s in pts)
    by = sum(t**2 * s for t, s in pts)
    det = sxx * syy - sxy**2
    a, b = (bx * syy - by * sxy) / det, (by * sxx - bx * sxy) / det
    if a < 0 or b < 0:  # the better one-term law
        one = [(bx / sxx, 0.0), (0.0, by / syy)]
        a, b = min(one, key=lambda ab: sum((ab[0] * t + ab[1] * t**2 - s)**2 for t, s in pts))
    return {"a": a, "b": b, "n": len(pts)}


def at(fit, T):
    return fit["a"] * T + fit["b"] * T**2


def attention_shape(cfg):
    """b / a of the step-time law from FLOPs: causal attention costs 6 L H D T per token (forward + backward),
    the matmuls 6 x their parameters (LM head included); attention runs at about half the GEMM rate on the
    CPU (`oomless probe`), hence the 2."""
    E, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    H, Hkv, F = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    D = cfg.get("head_dim") or E // H
    matmul = L * (E * H * D + 2 * E * Hkv * D + H * D * E + 3 * E * F) + V * E
    return 2.0 * L * H * D / matmul


def slope(points):
    """Least-squares slope of y against x; None under two distinct x."""
    if len({x for x, _ in points}) < 2:
        return None
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx)**2 for x, _ in points)


# ---------------------------------------------------------------------------------------------------------
# One run of each system.

KV_LINE = re.compile(r"kv offload \(([^)]*)\): (.+?) out, (.+?) in; compute waited ([\d.]+) s on transfers "
                     r"\(([\d.]+)% of ([\d.]+) s\)")


def parse_oomless(res, out, T):
    """Fields of an oomless run from its metrics.jsonl (the step's line) and stdout."""
    last = [r for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if r.get("type") == "train"][-1]
    mem = last["memory"]
    tier = lambda name: mem.get(name, {}).get("total", {}).get("peak")
    row = {"step_s": T / last["tokens_per_s"], "loss": last["loss"], "device_peak": tier("device"),
           "host_peak": tier("host"), "disk_peak": tier("disk")}
    row["ledger_peak"] = (row["device_peak"] or 0) + (row["host_peak"] or 0)
    m = KV_LINE.search(res["text"])
    if m:
        # The wait's share as the run printed it (its total is printed to 0.01 s: 0.00 for a fast step).
        row.update(kv_io=m.group(1), kv_out=parse_size(m.group(2)), kv_in=parse_size(m.group(3)),
                   wait_s=float(m.group(4)), wait_frac=float(m.group(5)) / 100)
    return row


def parse_torch(res):
    lines = [line for line in res["text"].splitlines() if line.startswith('{"T"')]
    r = json.loads(lines[-1])
    return {"step_s": r["step_s"], "loss": r["loss"], "torch": r.get("torch"), "transformers": r.get("transformers")}


def failed(res):
    if res["timed_out"]:
        return "timed out"
    if res["rc"] != 0:
        return "killed (cgroup limit?)" if res["rc"] in (137, -9) else f"failed (exit {res['rc']})"
    return None


# ---------------------------------------------------------------------------------------------------------

def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--oomless", default=os.path.join(ROOT, "build/release/oomless"))
    ap.add_argument("--python", default=os.path.join(ROOT, "tools/golden/.venv/bin/python"),
                    help="the venv with torch + transformers (bench/peers/setup.sh)")
    ap.add_argument("--work", default=os.path.join(ROOT, "build/long"))
    ap.add_argument("--models", default="tiny,smollm2-135m")
    ap.add_argument("--modes", default="none,disk,host", help="chunk-recurrent --kv-offload modes, in run order")
    ap.add_argument("--t-min", type=int, default=8192, help="first T of the chunk-recurrent runs")
    ap.add_argument("--disk-t-min", type=int, default=4096,
                    help="first T of the disk mode (one chunk: its memory slope then has two measured T's even "
                         "where only --t-min fits the time box)")
    ap.add_argument("--full-t-min", type=int, default=1024, help="first T of full-sequence oomless and PyTorch")
    ap.add_argument("--t-max", type=int, default=131072, help="last T (rows past the time box are extrapolated)")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--chunk-save-policy", default="none",
                    help="--save-policy inside a chunk (none: keep block inputs, recompute; as full-sequence runs)")
    ap.add_argument("--full-save-policy", default="none", help="--save-policy of the full-sequence oomless runs")
    ap.add_argument("--no-full", dest="full", action="store_false", help="skip full-sequence oomless")
    ap.add_argument("--torch", dest="torch", action="store_true", default=True)
    ap.add_argument("--no-torch", dest="torch", action="store_false", help="skip the PyTorch side")
    ap.add_argument("--time-box", default="150,smollm2-135m=300",
                    help="longest predicted step to run, seconds: a default and/or MODEL=S, MODEL.MODE=S "
                         "(MODE: torch, full, none, host, disk)")
    ap.add_argument("--deadline", type=float, default=2520,
                    help="seconds for the whole invocation; runs that would end after it are extrapolated")
    ap.add_argument("--repeats", type=int, default=1, help="runs per measured point (median step, max memory)")
    ap.add_argument("--budget", default="4GiB", help="peak-RSS budget B of the longest-T comparison")
    ap.add_argument("--cgroup-limit", default="auto", help="memory limit of each run's cgroup (auto: 3/4 of RAM)")
    ap.add_argument("--spill-dir", default=None, help="folder of the disk mode's spill files (default WORK/spill)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="results file (default bench/long_context/results/DATE.json)")
    ap.add_argument("--svg", default=os.path.join(ROOT, "docs/long_context_memory.svg"))
    ap.add_argument("--add-to", default=None, metavar="RESULTS.json",
                    help="an earlier results file: its rows are kept except those this run measures again (same "
                         "model, mode and T); the summary, table and plot are made from both")
    ap.add_argument("--smoke", action="store_true",
                    help="oomless only, preset:micro at T 256-512, chunk 128; results in WORK (see the top of the file)")
    a = ap.parse_args()
    if a.smoke:
        a.models, a.t_min, a.disk_t_min, a.full_t_min, a.t_max, a.chunk, a.page = "micro", 256, 256, 256, 512, 128, 32
        a.torch, a.time_box, a.deadline = False, "120", 600
        a.json = a.json or os.path.join(a.work, "smoke.json")
        a.svg = os.path.join(a.work, "smoke.svg")
    a.budget = parse_size(a.budget)
    a.time_box = dict(kv.split("=") if "=" in kv else ("", kv) for kv in a.time_box.split(","))
    a.modes = [m for m in a.modes.split(",") if m]
    assert all(m in CHUNKED for m in a.modes), f"--modes: each of {', '.join(CHUNKED)}"
    a.spill_dir = a.spill_dir or os.path.join(a.work, "spill")
    a.json = a.json or os.path.join(HERE, "results", datetime.date.today().isoformat() + ".json")
    return a


def ram_bytes():
    for line in open("/proc/meminfo"):
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 16 * 2**30


class Bench:
    def __init__(self, a):
        self.a = a
        self.t0 = time.perf_counter()
        self.rows = []
        self.env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), TOKENIZERS_PARALLELISM="false")
        limit = 3 * ram_bytes() // 4 if a.cgroup_limit == "auto" else parse_size(a.cgroup_limit)
        self.cgroup = Cgroup(limit)
        self.model_end = None
        self.shape = None
        os.makedirs(os.path.join(a.work, "runs"), exist_ok=True)
        os.makedirs(a.spill_dir, exist_ok=True)

    def elapsed(self):
        return time.perf_counter() - self.t0

    # -- data --------------------------------------------------------------------------------------------
    def prepare(self, model):
        """The init folder and .ids of a model: reused from bench/peers' work folders (build/peers or
        BUILD/peers) when there, else made in WORK."""
        build = os.path.dirname(os.path.abspath(self.a.oomless))
        for d in (self.a.work, os.path.join(ROOT, "build/peers"), os.path.join(build, "peers")):
            init, ids = os.path.join(d, f"init-{model}"), os.path.join(d, f"{model}.ids")
            if os.path.exists(os.path.join(init, "model.safetensors")) and os.path.exists(ids):
                return init, ids
        init, ids = os.path.join(self.a.work, f"init-{model}"), os.path.join(self.a.work, f"{model}.ids")
        sh([self.a.oomless, "convert", "--model", f"preset:{model}", "--seed", "0", "--out", init])
        out = sh([self.a.oomless, "tokenize", "--model", init, "--text-file", os.path.join(ROOT, "data/kjv/train.txt"),
                  "--no-special"]).stdout
        with open(ids + ".tmp", "w") as f:
            f.write(out)
        os.replace(ids + ".tmp", ids)
        return init, ids

    def ids_for(self, ids, T):
        """ids itself when it holds T + 1 tokens (a sequence takes T + 1), else a copy repeated enough times."""
        with open(ids) as f:
            text = f.read()
        n = len(text.split())
        if n > T:
            return ids
        reps = T // n + 1
        longer = os.path.join(self.a.work, f"{os.path.basename(ids)[:-4]}.x{reps}.ids")
        if not os.path.exists(longer):
            line = " ".join(text.split()) + "\n"
            with open(longer + ".tmp", "w") as f:
                f.write(line * reps)
            os.replace(longer + ".tmp", longer)
        return longer

    # -- runs --------------------------------------------------------------------------------------------
    def box(self, model, mode):
        tb = self.a.time_box
        return float(tb.get(f"{model}.{mode}", tb.get(model, tb.get("", 300))))

    def hard_timeout(self, model, mode):
        """A run is killed after twice its time box and three minutes (start, load, checkpoint)."""
        return 2 * self.box(model, mode) + 180

    def run_oomless(self, model, init, ids, mode, T):
        a = self.a
        out = os.path.join(a.work, "runs", f"{model}.{mode}.T{T}")
        subprocess.run(["rm", "-rf", out])
        cmd = [a.oomless, "train", "--model", init, "--data", self.ids_for(ids, T), "--seq", str(T), "--batch", "1",
               "--steps", "1", "--threads", str(a.threads), "--eval-every", "0", "--save-every", "0", "--out", out,
               "--dtype", "fp32", "--warmup", "0"]
        if mode == "full":
            cmd += ["--save-policy", a.full_save_policy]
        else:
            cmd += ["--chunk", str(a.chunk), "--page", str(a.page), "--kv-offload", mode,
                    "--save-policy", a.chunk_save_policy] + (["--spill-dir", a.spill_dir] if mode == "disk" else [])
        res = measure(cmd, out + ".log", self.env, self.cgroup, self.hard_timeout(model, mode))
        row = {"error": failed(res)} if failed(res) else parse_oomless(res, out, T)
        subprocess.run(["sh", "-c", 'rm -rf "$0"/checkpoint-*', out])  # the final checkpoint: GBs, not needed
        return res, row

    def run_torch(self, model, init, ids, T):
        a = self.a
        log = os.path.join(a.work, "runs", f"{model}.torch.T{T}.log")
        cmd = [a.python, os.path.join(HERE, "train_torch_long.py"), "--model", init, "--ids", ids, "--seq", str(T),
               "--threads", str(a.threads)]
        res = measure(cmd, log, self.env, self.cgroup, self.hard_timeout(model, "torch"))
        return res, ({"error": failed(res)} if failed(res) else parse_torch(res))

    def measured(self, model, init, ids, mode, T):
        """--repeats runs of one point: median step time, largest memory figures."""
        reps = []
        for _ in range(self.a.repeats):
            res, row = (self.run_torch(model, init, ids, T) if mode == "torch"
                        else self.run_oomless(model, init, ids, mode, T))
            row.update(rss=res["rss"], cgroup_max=res["cgroup_max"], cgroup_anon=res["cgroup_anon"], wall_s=res["wall"])
            reps.append(row)
            if "error" in row:
                return {**row, "status": row["error"]}
        row = dict(reps[-1], status="measured", repeats=len(reps))
        row["step_s"] = statistics.median(r["step_s"] for r in reps)
        row["step_s_all"] = [r["step_s"] for r in reps]
        for k in ("rss", "cgroup_max", "cgroup_anon", "ledger_peak", "device_peak", "host_peak", "disk_peak"):
            vals = [r[k] for r in reps if r.get(k) is not None]
            row[k] = max(vals) if vals else None
        return row

    # -- the plan ----------------------------------------------------------------------------------------
    def series_points(self, model, mode):
        """Measured (T, step) of the series; a chunk-recurrent series with under two T's takes those of all
        the model's chunk-recurrent modes (the same arithmetic, the history elsewhere)."""
        pts = lambda modes: [(r["T"], r["step_s"]) for r in self.rows
                             if r["model"] == model and r["mode"] in modes and r["status"] == "measured"]
        own = pts((mode,))
        if mode in CHUNKED and len({t for t, _ in own}) < 2:
            return pts(CHUNKED)
        return own

    def overhead(self, model, mode):
        """Seconds a run takes beyond its step (start, load, save): the largest seen for this model/system."""
        torch = mode == "torch"
        seen = [r["wall_s"] - r["step_s"] for r in self.rows if r["model"] == model and r["status"] == "measured"
                and (r["mode"] == "torch") == torch]
        return max(seen) if seen else 30.0

    def decide(self, model, mode, T):
        """None to run the point, else the reason it is extrapolated; and the fit used."""
        fit = fit_step(self.series_points(model, mode), self.shape)
        if fit is None:
            return None, None
        step = at(fit, T)
        if step > self.box(model, mode):
            return f"extrapolated (predicted {step:.0f} s > time box)", fit
        if self.elapsed() + 1.2 * step + self.overhead(model, mode) > self.model_end:  # 20% for misprediction
            return f"extrapolated (predicted {step:.0f} s: past the deadline)", fit
        return None, fit

    def point(self, model, init, ids, mode, T):
        """Runs or extrapolates one (model, mode, T); returns False when the series ends here."""
        why, fit = self.decide(model, mode, T)
        base = {"model": model, "mode": mode, "system": "torch" if mode == "torch" else "oomless", "T": T,
                "chunk": self.a.chunk if mode in CHUNKED else None}
        if why:
            row = dict(base, status=why, step_s=at(fit, T), fit=fit)
        else:
            row = dict(base, **self.measured(model, init, ids, mode, T))
            if fit:
                row["predicted_s"] = at(fit, T)
        self.rows.append(row)
        self.report(row)
        if mode in CHUNKED:
            return row["status"] == "measured" or row["status"].startswith("extrapolated")
        return row["status"] == "measured" and (row["rss"] or 0) <= self.a.budget

    def report(self, r):
        what = f"{r['model']} {r['mode']} T={r['T']}"
        if r["status"] != "measured":
            extra = f" step ~{r['step_s']:.1f} s" if r.get("step_s") else ""
            print(f"[{self.elapsed():5.0f} s / {self.a.deadline:.0f} s] {what}: {r['status']}{extra}", flush=True)
            return
        wait = f", waited {100 * r['wait_frac']:.1f}%" if r.get("wait_frac") is not None else ""
        ledger = f", ledger D+H {mib(r.get('ledger_peak'))}" if r["system"] == "oomless" else ""
        print(f"[{self.elapsed():5.0f} s / {self.a.deadline:.0f} s] {what}: step {r['step_s']:.2f} s{wait}, "
              f"peak RSS {mib(r['rss'])}{ledger}, cgroup max {mib(r['cgroup_max'])}, anon {mib(r['cgroup_anon'])} "
              f"(run {r['wall_s']:.0f} s)",
              flush=True)

    def sweep(self, model):
        """Every series of a model, T ascending; at each T the live series in order (PyTorch, full, chunked)."""
        a = self.a
        left = len(a.models) - a.models.index(model)
        self.model_end = self.elapsed() + (a.deadline - self.elapsed()) / left
        init, ids = self.prepare(model)
        self.shape = attention_shape(json.load(open(os.path.join(init, "config.json"))))
        series = (["torch"] if a.torch else []) + (["full"] if a.full else []) + a.modes
        first = {m: a.t_min if m in CHUNKED else a.full_t_min for m in series}
        if "disk" in first:
            first["disk"] = min(a.t_min, a.disk_t_min)
        grid = {m: [first[m] * 2**k for k in range(64) if first[m] * 2**k <= a.t_max] for m in series}
        live = set(series)
        for T in sorted(set(t for ts in grid.values() for t in ts)):
            for m in series:
                if m in live and T in grid[m] and not self.point(model, init, ids, m, T):
                    live.discard(m)

    def box_text(self):
        return ", ".join(f"{k or 'default'} {v} s" for k, v in self.a.time_box.items())

    def run(self):
        a = self.a
        print(f"{a.threads} threads; chunk {a.chunk}, page {a.page}, save policy {a.chunk_save_policy} (chunked) / "
              f"{a.full_save_policy} (full); time box {self.box_text()}, deadline {a.deadline:.0f} s; "
              f"budget {a.budget / 2**30:.2f} GiB; {self.cgroup.describe()}", flush=True)
        a.models = [m for m in a.models.split(",") if m]
        for model in a.models:
            self.sweep(model)
        return self.rows


# ---------------------------------------------------------------------------------------------------------
# Summary: floors and the budget comparison.

def by(rows, model, mode):
    """The measured rows of a series, T ascending."""
    return sorted((r for r in rows if r["model"] == model and r["mode"] == mode and r["status"] == "measured"),
                  key=lambda r: r["T"])


def time_floors(rows, model):
    none = {r["T"]: r for r in by(rows, model, "none")}
    out = []
    for r in by(rows, model, "disk"):
        if r["T"] in none:
            x = r["step_s"] / none[r["T"]]["step_s"]
            out.append({"model": model, "T": r["T"], "ratio": x, "pass": x <= 1.10})
    return out


def disk_slope(rows, model):
    pts = by(rows, model, "disk")
    s = slope([(r["T"], r["ledger_peak"]) for r in pts])
    rss = slope([(r["T"], r["rss"]) for r in pts if r["rss"]])
    per_1k = lambda v: None if v is None else v * 1024 / 1e6
    return {"model": model, "T": [r["T"] for r in pts], "ledger_mb_per_1k": per_1k(s), "rss_mb_per_1k": per_1k(rss),
            "pass": None if s is None else s * 1024 / 1e6 <= 0.5}


def max_t(rows, model, mode, budget, extrapolate):
    """Largest measured T with peak RSS <= budget ("over": whether a measured T went over it, else the
    time box or --t-max ended the series first), and an estimate: linear in T through the last two measured
    points (extrapolate="line") or the least-squares RSS slope from the last point ("slope")."""
    pts = [(r["T"], r["rss"]) for r in by(rows, model, mode) if r["rss"]]
    under = [t for t, m in pts if m <= budget]
    res = {"mode": mode, "points": len(pts), "measured": max(under) if under else None,
           "over": any(m > budget for _, m in pts), "estimate": None, "how": None}
    if len(pts) < 2:
        return res
    if extrapolate == "slope":
        s, (t1, m1) = slope(pts), pts[-1]
        if s is not None and s > 0 and m1 <= budget:
            res.update(estimate=t1 + (budget - m1) / s, how="disk: RSS slope from the last point")
        elif s is not None and s <= 0:
            res.update(estimate=float("inf"), how="disk: RSS does not grow with T")
        return res
    (t0, m0), (t1, m1) = pts[-2], pts[-1]
    if m1 != m0:
        res.update(estimate=t0 + (budget - m0) * (t1 - t0) / (m1 - m0),
                   how=f"{mode}: {'interpolated' if m1 > budget else 'extrapolated'} through the last two points")
    return res


def ratio(num, den, k):
    """num / den of max_t results: value and kind. Measured: exact when both series went over the budget;
    a lower bound when only the denominator did; uncertain when the denominator did not."""
    x, y = num[k], den[k]
    if x is None or y is None or y == 0:
        return {"value": None, "kind": "n/a"}
    kind = "estimate" if k == "estimate" else \
        ("exact" if num["over"] else "lower bound") if den["over"] else "uncertain"
    return {"value": x / y, "kind": kind}


PAIRS = (("disk", "torch"), ("full", "torch"), ("disk", "full"))


def budget_comparison(rows, model, budget):
    c = {"model": model, "budget": budget, "torch": max_t(rows, model, "torch", budget, "line"),
         "full": max_t(rows, model, "full", budget, "line"), "disk": max_t(rows, model, "disk", budget, "slope")}
    for n, d in PAIRS:
        for k in ("measured", "estimate"):
            c[f"{n}_vs_{d}_{k}"] = ratio(c[n], c[d], k)
    if model == FLOOR_MODEL:
        c["floor"] = {k: verdict(c[f"disk_vs_torch_{k}"], 8) for k in ("measured", "estimate")}
    return c


def verdict(r, floor):
    if r["value"] is None or r["kind"] == "uncertain":
        return "n/a"
    if r["value"] >= floor:
        return "PASS"
    return "NOT SHOWN" if r["kind"] == "lower bound" else "FAIL"


# ---------------------------------------------------------------------------------------------------------
# Output: the table, the floors, the SVG.

def fmt_t(T):
    if T is None:
        return "-"
    if T == float("inf"):
        return "unbounded"
    if T < 1024:
        return f"{T:.0f}"
    return f"{T / 1024:.0f}K" if T % 1024 == 0 or T >= 64 * 1024 else f"{T / 1024:.1f}K"


def fmt_x(r):
    x = r["value"]
    if x is None:
        return "-"
    text = "inf" if x == float("inf") else f"{x:.1f}x"
    return {"lower bound": ">= " + text, "uncertain": text + " (uncertain: the denominator never went over B)"}.get(
        r["kind"], text)


def table(rows):
    print("\n| model | mode | T | status | step s | tokens/s | compute waiting | Device+Host (ledger) | Disk (ledger) "
          "| peak RSS | cgroup max | cgroup anon |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        step = r.get("step_s")
        step_s, tps = ("-", "-") if step is None else (f"{step:.2f}", f"{r['T'] / step:.0f}")
        wait = f"{100 * r['wait_frac']:.1f}%" if r.get("wait_frac") is not None else "-"
        status = r["status"]
        if r.get("fit"):
            f = r["fit"]
            status += f"; fit a={f['a']:.3g} s/token, b={f['b']:.3g} s/token^2 ({f['n']} points{f.get('note', '')})"
        mem = " | ".join(mib(r.get(k)) for k in ("ledger_peak", "disk_peak", "rss", "cgroup_max", "cgroup_anon"))
        print(f"| {r['model']} | {r['mode']} | {r['T']} | {status} | {step_s} | {tps} | {wait} | {mem} |")


def print_floors(summary, budget):
    print()
    for f in summary["time_floors"]:
        print(f"{'PASS' if f['pass'] else 'FAIL'}: {f['model']} T={f['T']}: disk step / none step = "
              f"{f['ratio']:.3f} (floor <= 1.10)")
    for s in summary["slopes"]:
        if s["pass"] is None:
            print(f"n/a : {s['model']}: disk slope needs two measured T (have {s['T']})")
        else:
            print(f"{'PASS' if s['pass'] else 'FAIL'}: {s['model']}: disk Device+Host ledger slope "
                  f"{s['ledger_mb_per_1k']:.3f} MB per 1K tokens over T = {s['T']} (floor <= 0.5); peak RSS slope "
                  f"{s['rss_mb_per_1k'] or 0:.3f} MB per 1K tokens")
    for c in summary["budget"]:
        print_budget(c, budget)


def print_budget(c, budget):
    m = c["model"]
    names = (("PyTorch", "torch"), ("oomless full-sequence", "full"), ("oomless disk", "disk"))
    def measured(key):
        r = c[key]
        if not r["points"]:
            return "not run"
        if r["measured"] is None:
            return "none (the first T is over B)"
        return fmt_t(r["measured"]) + ("" if r["over"] else " (never over B)")
    print(f"\n{m}, longest T with peak RSS <= B = {budget / 2**30:.2f} GiB, measured: "
          + ", ".join(f"{name} {measured(key)}" for name, key in names))
    print(f"{m}, estimated: " + ", ".join(f"{name} {fmt_t(c[key]['estimate'])}" for name, key in names)
          + " (" + "; ".join(c[key]["how"] for _, key in names if c[key]["how"]) + ")")
    for k in ("measured", "estimate"):
        print(f"{m} ({k}): oomless disk / PyTorch {fmt_x(c[f'disk_vs_torch_{k}'])}; gain from fused CE + recompute "
              f"(full / PyTorch) {fmt_x(c[f'full_vs_torch_{k}'])}; gain from chunking (disk / full) "
              f"{fmt_x(c[f'disk_vs_full_{k}'])}")
    for k, v in c.get("floor", {}).items():
        print(f"{v}: {m}: oomless disk max T >= 8x PyTorch's under B ({k}: {fmt_x(c[f'disk_vs_torch_{k}'])})")


COLORS = {"torch": "#d62728", "full": "#ff7f0e", "none": "#1f77b4", "host": "#2ca02c", "disk": "#9467bd"}
NAMES = {"torch": "PyTorch + transformers", "full": "oomless full-sequence", "none": "oomless chunked, K/V: device",
         "host": "oomless chunked, K/V: host", "disk": "oomless chunked, K/V: disk"}


def svg_panel(rows, model, y0, w, h, budget, chunk):
    """One model's panel: peak RSS (solid) and ledger Device + Host (dashed) against log2 T."""
    pts = [r for r in rows if r["model"] == model and r["status"] == "measured" and r.get("rss")]
    if not pts:
        return []
    ts = [r["T"] for r in pts]
    lo, hi = math.log2(min(ts)), math.log2(max(ts))
    top = max(max(r["rss"] for r in pts), budget) / MiB * 1.08
    L, R, T_, B = 70, w - 230, y0 + 30, y0 + h - 40
    x = lambda t: L + (math.log2(t) - lo) / max(hi - lo, 1) * (R - L)
    y = lambda v: B - v / MiB / top * (B - T_)
    out = [f'<text x="{L}" y="{y0 + 18}"><tspan font-weight="bold">{model}</tspan>: peak memory of one training '
           f'step (batch 1, fp32; chunk-recurrent: C = {chunk})</text>',
           f'<line x1="{L}" y1="{B}" x2="{R}" y2="{B}" stroke="#444"/>',
           f'<line x1="{L}" y1="{T_}" x2="{L}" y2="{B}" stroke="#444"/>']
    step = 10 ** math.floor(math.log10(top / 4))
    step *= 5 if top / step > 20 else 2 if top / step > 8 else 1
    for k in range(0, int(top / step) + 1):
        yy = y(k * step * MiB)
        out.append(f'<line x1="{L}" y1="{yy:.1f}" x2="{R}" y2="{yy:.1f}" stroke="#eee"/>'
                   f'<text x="{L - 4}" y="{yy + 4:.1f}" text-anchor="end">{k * step:g}</text>')
    for e in range(math.ceil(lo), int(hi) + 1):
        out.append(f'<text x="{x(2**e):.1f}" y="{B + 14}" text-anchor="middle">{fmt_t(2**e)}</text>')
    out.append(f'<text x="{(L + R) / 2}" y="{B + 30}" text-anchor="middle">sequence length T (log scale)</text>')
    out.append(f'<text x="{L - 50}" y="{(T_ + B) / 2}" transform="rotate(-90 {L - 50} {(T_ + B) / 2})" '
               f'text-anchor="middle">MiB</text>')
    out.append(f'<line x1="{L}" y1="{y(budget):.1f}" x2="{R}" y2="{y(budget):.1f}" stroke="#000" '
               f'stroke-dasharray="2,3"/><text x="{L + 4}" y="{y(budget) - 4:.1f}">budget '
               f'{budget / 2**30:.2f} GiB</text>')
    legend = T_
    for mode in ("torch", "full") + CHUNKED:
        rs = [r for r in pts if r["mode"] == mode]
        if not rs:
            continue
        c = COLORS[mode]
        for key, dash in (("rss", ""), ("ledger_peak", ' stroke-dasharray="6,4"')):
            line = [(x(r["T"]), y(r[key])) for r in rs if r.get(key)]
            if line:
                d = " ".join(f"{'M' if i == 0 else 'L'}{px:.1f},{py:.1f}" for i, (px, py) in enumerate(line))
                out.append(f'<path d="{d}" fill="none" stroke="{c}" stroke-width="2"{dash}/>')
                out += [f'<circle cx="{px:.1f}" cy="{py:.1f}" r="2.5" fill="{c}"/>' for px, py in line]
        out.append(f'<line x1="{R + 12}" y1="{legend - 4}" x2="{R + 32}" y2="{legend - 4}" stroke="{c}" '
                   f'stroke-width="2"/><text x="{R + 36}" y="{legend}" fill="{c}">{NAMES[mode]}</text>')
        legend += 15
    out.append(f'<text x="{R + 12}" y="{legend + 6}">solid: peak RSS; dashed:</text>'
               f'<text x="{R + 12}" y="{legend + 20}">ledger Device + Host peak</text>')
    return out


def write_svg(rows, models, budget, chunk, path):
    w, h = 900, 330
    body = []
    for i, m in enumerate(models):
        body += svg_panel(rows, m, i * h, w, h, budget, chunk)
    H = h * len(models)
    text = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{H}" font-family="sans-serif" '
            f'font-size="11">\n<rect width="{w}" height="{H}" fill="white"/>\n' + "\n".join(body) + "\n</svg>\n")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def plain(x):
    """x with infinities as the string "inf" (JSON has none)."""
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return "inf" if x == float("inf") else x


def merged(earlier, rows, models):
    """The rows of an earlier results file with this run's on top: a (model, mode, T) this run has replaces
    the earlier row; models in the earlier order, new ones after; rows by model, then T, then series."""
    key = lambda r: (r["model"], r["mode"], r["T"])
    new = {key(r) for r in rows}
    out = [r for r in earlier["rows"] if key(r) not in new] + rows
    order = list(dict.fromkeys([r["model"] for r in earlier["rows"]] + models))
    series = ("torch", "full") + CHUNKED
    out.sort(key=lambda r: (order.index(r["model"]), r["T"], series.index(r["mode"])))
    return out, order


def main():
    a = parse_args()
    earlier = None
    if a.add_to:
        with open(a.add_to) as f:
            earlier = json.load(f)
    # The machine, so that runs on different days can be told apart (figures are compared within a run).
    probe = json.loads(sh([a.oomless, "probe", "--json", "--threads", str(a.threads)]).stdout)
    print(f"machine: {probe.get('cpu')} ({probe.get('isa')}); fp32 GEMM {probe.get('gemm_f32_gflops', 0):.1f} GFLOP/s",
          flush=True)
    bench = Bench(a)
    rows = bench.run()
    if earlier:
        rows, a.models = merged(earlier, rows, a.models)
    summary = {"time_floors": [f for m in a.models for f in time_floors(rows, m)],
               "slopes": [disk_slope(rows, m) for m in a.models],
               "budget": [budget_comparison(rows, m, a.budget) for m in a.models]}
    torch = next((r for r in rows if r.get("torch")), {})
    results = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "args": vars(a),
               "added_to": {"file": os.path.relpath(a.add_to, ROOT), "date": earlier.get("date"),
                            "args": earlier.get("args")} if earlier else None,
               "cgroup": bench.cgroup.describe(), "probe": probe, "torch": torch.get("torch"),
               "transformers": torch.get("transformers"), "elapsed_s": bench.elapsed(), "rows": rows,
               "summary": summary}
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(plain(results), f, indent=1)
    write_svg(rows, a.models, a.budget, a.chunk, a.svg)
    table(rows)
    print_floors(summary, a.budget)
    print(f"\nresults: {a.json}; plot: {a.svg}; {bench.elapsed():.0f} s in all")
    if a.smoke:
        bad = [f"{r['mode']} T={r['T']}: {r['status']}" for r in rows if r["status"] != "measured"]
        if bad:
            sys.exit("run.py --smoke: not every run was measured: " + "; ".join(bad))


if __name__ == "__main__":
    main()
