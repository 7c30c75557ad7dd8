# What the MPI scripts share (dist_dp.sh, dist_cp.sh), sourced after they set bin, src and work: the skips
# (exit 77) where mpirun, an MPI build or python3 is missing, a fresh work folder, mpirun's settings for this
# machine, and
#   mpi N ARGS...         oomless on N ranks;
#   close A B TOL         two safetensors files' f32 tensors within TOL (max |a - b| / max |a|, per tensor);
#   losses METRICS        the training losses of a metrics.jsonl, one line;
#   same_losses A B       two such lines within 1e-6 relative.
command -v mpirun > /dev/null 2>&1 || { echo "no mpirun: skipped"; exit 77; }
"$bin" --version | grep -q "MPI compiled in" || { echo "oomless built without MPI: skipped"; exit 77; }
command -v python3 > /dev/null 2>&1 || { echo "no python3: skipped"; exit 77; }
rm -rf "$work"; mkdir -p "$work"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
# Under the sanitizer build: the MPI library's own allocations at exit are not this program's leaks.
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
mpi() { n=$1; shift; mpirun -np "$n" "$bin" "$@"; }

# The tensors of two safetensors files within `tol` (max |a - b| / max |a|, per tensor), or byte-equal (tol 0).
close() {
  python3 - "$1" "$2" "$3" <<'EOF'
import json, struct, sys, array
def read(p):
    b = open(p, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n]); h.pop("__metadata__", None)
    out = {}
    for k, v in h.items():
        if v["dtype"] != "F32":
            continue
        s, e = v["data_offsets"]
        a = array.array("f"); a.frombytes(b[8 + n + s:8 + n + e]); out[k] = a
    return out
a, b, tol = read(sys.argv[1]), read(sys.argv[2]), float(sys.argv[3])
assert a.keys() == b.keys() and a, "different tensors"
worst = 0.0
for k in a:
    scale = max(max(abs(x) for x in a[k]), 1e-30)
    worst = max(worst, max(abs(x - y) for x, y in zip(a[k], b[k])) / scale)
print(f"max relative difference {worst:.3g}")
sys.exit(0 if worst <= tol else 1)
EOF
}
losses() { python3 -c "import json,sys; print(' '.join('%.9f' % json.loads(l)['loss'] for l in open(sys.argv[1]) if '\"train\"' in l))" "$1"; }
same_losses() {  # relative 1e-6
  python3 -c "
import sys
a, b = [list(map(float, s.split())) for s in sys.argv[1:3]]
sys.exit(0 if len(a) == len(b) and all(abs(x - y) <= 1e-6 * abs(x) for x, y in zip(a, b)) else 1)" "$1" "$2"
}
near_losses() {  # relative 1e-4 (gradients summed in bf16)
  python3 -c "
import sys
a, b = [list(map(float, s.split())) for s in sys.argv[1:3]]
sys.exit(0 if len(a) == len(b) and all(abs(x - y) <= 1e-4 * abs(x) for x, y in zip(a, b)) else 1)" "$1" "$2"
}
# `estimate_is_ledger RUN ARGS...`: `oomless estimate ARGS --json` gives the peak of the largest rank's ledger in the
# last train line of RUN/metrics.jsonl, within 4 KiB or 0.02%, the larger (both printed): on these 4-16 MB runs the
# two differ by about 50 bytes; a 1% bound let a 147 KB buffer the estimate had left out pass, and 16 KiB a 6 KB
# one (a context-parallel rank's own key gradients, seen once ZeRO made rank 0 the largest).
estimate_is_ledger() {
  eil_run=$1; shift
  "$bin" estimate "$@" --json > "$eil_run.estimate.json" || { echo "estimate $*: failed"; return 1; }
  python3 - "$eil_run.estimate.json" "$eil_run/metrics.jsonl" <<'PY'
import json, sys
est = json.load(open(sys.argv[1]))['estimate']['ram_peak']
led = max([json.loads(l) for l in open(sys.argv[2]) if '"train"' in l][-1]['ranks']['peak'])
print('estimate %d bytes, the largest rank\'s ledger %d' % (est, led))
sys.exit(0 if abs(est - led) <= max(4096, 0.0002 * led) else 1)
PY
}
# `holds_less RUN REF WHAT`: in the last train lines of their metrics.jsonl, RUN's rank 0 holds fewer bytes of WHAT
# (a ledger category: grads, weights, ...; or peak: the largest rank's peak) than REF's (both printed).
holds_less() {
  python3 - "$1/metrics.jsonl" "$2/metrics.jsonl" "$3" <<'PY'
import json, sys
last = lambda p: [json.loads(l) for l in open(p) if '"train"' in l][-1]
def held(row, what):
    if what == 'peak':
        return max(row['ranks']['peak']) if 'ranks' in row else sum(row['memory'][t]['total']['peak'] for t in row['memory'] if t != 'disk')
    return sum(row['memory'][t].get(what, {}).get('peak', 0) for t in row['memory'] if isinstance(row['memory'][t], dict))
a, b = held(last(sys.argv[1]), sys.argv[3]), held(last(sys.argv[2]), sys.argv[3])
print('%s: %d bytes, against %d' % (sys.argv[3], a, b))
sys.exit(0 if a < b else 1)
PY
}
