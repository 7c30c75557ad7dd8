#include "plan/cost.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <vector>

#include "core/cpu_info.h"
#include "core/error.h"
#include "memory/spill_file.h"
#include "train/estimate.h"

namespace oomless {

namespace fs = std::filesystem;

namespace {

constexpr int64_t kCutLayers = 4;  // the larger cut (measure_costs)
// The vocabulary of the cuts that time the layers (measure_costs): a layer's time does not depend on it, and
// with the model's own (SmolLM2's 49152) the embedding and head were most of both steps whose difference gave
// the layers, so that a step's noise, not the layers, decided that difference.
constexpr int64_t kNarrowVocab = 1024;

// The model cut to L layers, as a config.json of its own (random init; an EOS id when it names none, which
// packing needs and timing does not). narrow: with a vocabulary of at most kNarrowVocab (token ids 0).
std::string cut_model(const ModelConfig& cfg, int64_t L, const std::string& scratch, bool narrow = false) {
  json::Value j = cfg.to_json();
  j.set("num_hidden_layers", json::Value::integer(L));
  if (!cfg.eos_id) j.set("eos_token_id", json::Value::integer(0));
  narrow = narrow && cfg.V > kNarrowVocab;
  if (narrow) {
    j.set("vocab_size", json::Value::integer(kNarrowVocab));
    j.set("eos_token_id", json::Value::integer(0));
    if (cfg.bos_id) j.set("bos_token_id", json::Value::integer(0));
  }
  const fs::path dir = fs::path(scratch) / ("plan-cut-" + std::to_string(L) + (narrow ? "-narrow" : ""));
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << json::dump(j);
  return (dir / "config.json").string();
}

// Steps of a and b after setup (whose dry run warms the kernels) and one more step each: the median seconds of
// a's, and the median of b's minus a's taken round by round. Where both fit `budget` together (0: no limit) the
// two trainers live side by side and step in turns (a b, then b a), so that the machine's drift between two
// runs, 10-25% within minutes on a shared host, falls on both sides of each difference; otherwise one after the
// other. At least `reps` rounds, more (up to 25) until a's steps add up to min_pair_seconds() (a second), so
// that small models' differences rise above noise.
struct PairTime {
  double a = 0, diff = 0;
};

// OOMLESS_PLAN_MIN_SECONDS: the seconds of a's steps that a pair's timing gathers at least (default 1; 0: just
// `reps` rounds, a rougher cost model in less time, which the tests of the planner's logic use).
double min_pair_seconds() {
  static const double s = [] {
    const char* v = std::getenv("OOMLESS_PLAN_MIN_SECONDS");
    if (!v || !*v) return 1.0;
    char* end = nullptr;
    const double x = std::strtod(v, &end);
    OOM_CHECK(end && *end == '\0' && x >= 0 && x <= 3600, "[plan] OOMLESS_PLAN_MIN_SECONDS=", v,
              " is not a number of seconds from 0 to 3600; unset it for the default (1)");
    return x;
  }();
  return s;
}

PairTime time_pair(const TrainConfig& ca, const TrainConfig& cb, int64_t V, int reps, size_t budget) {
  const StepBatch ba = synthetic_batch(ca.batch * ca.grad_accum, ca.seq, V);
  const StepBatch bb = synthetic_batch(cb.batch * cb.grad_accum, cb.seq, V);
  const double min_seconds = min_pair_seconds();
  auto more = [&](size_t n, double total) {
    return static_cast<int>(n) < reps || (total < min_seconds && n < 25);
  };
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::vector<double> ta, tb;
  double total = 0;
  if (budget == 0 || estimate_training(ca).ram_peak() + estimate_training(cb).ram_peak() <= budget) {
    Trainer a(ca, ""), b(cb, "");
    a.step(ba);
    b.step(bb);
    while (more(ta.size(), total)) {
      if (ta.size() % 2 == 0) {
        ta.push_back(a.step(ba).seconds);
        tb.push_back(b.step(bb).seconds);
      } else {
        tb.push_back(b.step(bb).seconds);
        ta.push_back(a.step(ba).seconds);
      }
      total += ta.back();
    }
  } else {
    {
      Trainer a(ca, "");
      a.step(ba);
      while (more(ta.size(), total)) {
        ta.push_back(a.step(ba).seconds);
        total += ta.back();
      }
    }
    Trainer b(cb, "");  // as many steps as a took
    b.step(bb);
    while (tb.size() < ta.size()) tb.push_back(b.step(bb).seconds);
  }
  std::vector<double> d(ta.size());
  for (size_t i = 0; i < ta.size(); ++i) d[i] = tb[i] - ta[i];
  return {median(ta), median(d)};
}

int64_t layer_params(const ModelConfig& cfg) {
  int64_t n = 0;
  for (const ParamSpec& s : param_specs(cfg))
    if (s.name.rfind("model.layers.0.", 0) == 0) {
      int64_t k = 1;
      for (int64_t d : s.shape) k *= d;
      n += k;
    }
  return n;
}

// Bytes per second writing then reading `bytes` through a spill file in `dir` (the engine's own I/O path).
void disk_rates(const std::string& dir, double* write_bps, double* read_bps) {
  constexpr size_t kSlot = size_t{16} << 20;
  constexpr int kSlots = 8;
  Ledger ledger;
  std::unique_ptr<SpillFile> f = SpillFile::open(dir, kSlot, ledger, Category::activations);
  std::vector<char> buf(kSlot, 1);
  std::vector<int64_t> slots;
  for (int i = 0; i < kSlots; ++i) slots.push_back(f->alloc_slot());
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t s : slots) f->write(s, buf.data(), kSlot);
  auto t1 = std::chrono::steady_clock::now();
  for (int64_t s : slots) f->read(s, buf.data(), kSlot);
  auto t2 = std::chrono::steady_clock::now();
  const double n = static_cast<double>(kSlot) * kSlots;
  *write_bps = n / std::max(1e-6, std::chrono::duration<double>(t1 - t0).count());
  *read_bps = n / std::max(1e-6, std::chrono::duration<double>(t2 - t1).count());
}

}  // namespace

const std::string& machine_cpu_name() {
  static const std::string name = [] {
    const CpuInfo cpu = detect_cpu();
    return cpu.model + " (" + cpu.isa_summary() + ")";
  }();
  return name;
}

int machine_threads() { return omp_get_max_threads(); }

int64_t cut_layers(const TrainConfig& c, const ModelConfig& cfg, const std::string& scratch, size_t budget) {
  // Fewer layers where the larger cut's run (everything kept, at --seq) would not fit the budget: the
  // measurement must not need more memory than the run it plans.
  int64_t K = std::min<int64_t>(kCutLayers, cfg.L);
  for (; budget > 0 && K > 2; --K) {
    TrainConfig t = c;
    t.model = cut_model(cfg, K, scratch);
    t.save_policy = "all";
    if (estimate_training(t).ram_peak() <= budget) break;
  }
  return K;
}

int64_t trained_params(const TrainConfig& c, const ModelConfig& cfg) {
  if (c.lora == 0) return cfg.param_count();
  int64_t n = 0;
  for (const ParamSpec& s : adapter_specs(cfg, *engine_options(c).lora)) {
    int64_t k = 1;
    for (int64_t d : s.shape) k *= d;
    n += k;
  }
  return n;
}

json::Value CostModel::json() const {
  json::Value o = json::Value::object();
  json::Value a = json::Value::object();
  for (const auto& [T, x] : at) {
    json::Value e = json::Value::object();
    e.set("block_s", json::Value::number(x.block));
    e.set("head_s", json::Value::number(x.head));
    e.set("recompute_none_s", json::Value::number(x.rec_none));
    e.set("recompute_selective_s", json::Value::number(x.rec_sel));
    e.set("kv_on_disk_s", json::Value::number(x.kv_disk));
    e.set("act_on_disk_s", json::Value::number(x.act_disk));
    a.set(std::to_string(T), std::move(e));
  }
  o.set("per_sequence_at_T", std::move(a));
  o.set("optimizer_s_per_param", json::Value::number(optim_per_param));
  o.set("optimizer_on_disk_s_per_param", json::Value::number(optim_disk_per_param));
  o.set("disk_write_bytes_per_s", json::Value::number(disk_write_bps));
  o.set("disk_read_bytes_per_s", json::Value::number(disk_read_bps));
  o.set("cpu", json::Value::string(cpu));
  o.set("threads", json::Value::integer(threads));
  o.set("cut_layers", json::Value::integer(cut_layers));
  return o;
}

CostModel measure_costs(const TrainConfig& c, const ModelSource& src, const std::vector<int64_t>& chunks,
                        const std::string& scratch, std::FILE* log, size_t budget) {
  const ModelConfig& cfg = src.cfg;
  CostModel cm;
  cm.cpu = machine_cpu_name();
  cm.threads = machine_threads();
  // A layer's costs are differences between the model cut to one layer and to K: K - 1 layers' worth, so that the
  // noise of two whole steps (the embedding and head dominate a small model's) is shared by several layers. With
  // K = 2, SmolLM2's per-layer figure moved 2x between two plans on the same machine.
  TrainConfig base = c;
  base.steps = 1 << 20, base.batch = 1, base.grad_accum = 1, base.eval_every = 0, base.out = "", base.data = "";
  base.budget = "", base.optim_state = "host", base.act_offload = "none", base.kv_offload = "none", base.spill_dir = "";
  base.save_policy = "all", base.step_in_backward = false, base.resume = false, base.sparse_pages = 0;
  const int64_t K = cut_layers(base, cfg, scratch, budget);
  cm.cut_layers = K;
  // one: the whole vocabulary (the embedding, head and optimizer); one_n and many: the narrow one (the layers).
  const std::string one = cut_model(cfg, 1, scratch), one_n = cut_model(cfg, 1, scratch, true),
                    many = cut_model(cfg, K, scratch, true);
  const int64_t Vn = std::min(cfg.V, kNarrowVocab);
  const double blocks = static_cast<double>(K - 1);
  const int reps = 3;
  const std::string spill = c.spill_dir.empty() ? scratch : c.spill_dir;
  // disk: "" or "optim" / "kv" / "act": that state (or the saved activations) on disk, in the run's spill folder.
  auto config = [&](const std::string& model, int64_t seq, int64_t chunk, int64_t batch, const char* policy,
                    const std::string& disk = "") {
    TrainConfig t = base;
    t.model = model, t.seq = seq, t.chunk = chunk, t.batch = batch, t.save_policy = policy;
    if (chunk > 0) t.page = c.page > 0 && chunk % c.page == 0 ? c.page : 0;
    if (disk == "optim") t.optim_state = "disk", t.spill_dir = spill;
    if (disk == "kv") t.kv_offload = "disk", t.spill_dir = spill;
    if (disk == "act") t.act_offload = "disk", t.spill_dir = spill;
    return t;
  };
  // What b's steps add to a's (seconds; never below zero).
  auto added = [&](const TrainConfig& a, const TrainConfig& b, int64_t V) {
    return std::max(0.0, time_pair(a, b, V, reps, budget).diff);
  };
  const double layer_p = c.lora > 0 ? 0 : static_cast<double>(layer_params(cfg));
  // The optimizer and one sequence at L = 1 (whole sequences at --seq, or the first chunk length).
  std::vector<int64_t> Ts;
  if (c.chunk == 0 || c.chunk >= c.seq) Ts.push_back(0);
  for (int64_t C : chunks) Ts.push_back(C);
  for (int64_t C : Ts) {
    // Chunks are timed over the whole sequence too, so that each chunk's attention sweeps the history it will.
    const int64_t seq = c.seq;
    const int64_t n_chunks = C > 0 ? c.seq / C : 1;
    if (log) std::fprintf(log, "oomless plan: measuring %s at T = %lld on this machine...\n",
                          C > 0 ? "chunks" : "whole sequences", static_cast<long long>(C > 0 ? C : c.seq));
    const TrainConfig one1 = config(one, seq, C, 1, "all"), manyK = config(many, seq, C, 1, "all");
    const TrainConfig one1n = config(one_n, seq, C, 1, "all");
    const PairTime p1 = time_pair(one1, config(one, seq, C, 2, "all"), cfg.V, reps, budget);
    const double per_seq1 = std::max(0.0, p1.diff), opt1 = std::max(0.0, p1.a - per_seq1);
    if (cm.optim_per_param == 0) {
      const int64_t trained = trained_params(c, open_model(one, static_cast<uint64_t>(c.seed)).cfg);
      cm.optim_per_param = opt1 / static_cast<double>(std::max<int64_t>(trained, 1));
      // What keeping the state on disk adds to a step, as the engine streams it (measured, not modelled: the
      // page cache and the window's overlap decide it).
      cm.optim_disk_per_param = added(one1, config(one, seq, C, 1, "all", "optim"), cfg.V) /
                                static_cast<double>(std::max<int64_t>(trained, 1));
    }
    CostModel::AtT a;
    const double per_layer_chunk = static_cast<double>(K) * static_cast<double>(n_chunks);
    if (C > 0) a.kv_disk = added(manyK, config(many, seq, C, 1, "all", "kv"), Vn) / per_layer_chunk;
    if (blocks > 0) {
      const double layers = added(one1n, manyK, Vn);  // K - 1 layers and their optimizer step
      a.block = std::max(0.0, layers - cm.optim_per_param * layer_p * blocks) / (blocks * static_cast<double>(n_chunks));
      a.rec_none = added(manyK, config(many, seq, C, 1, "none"), Vn) / per_layer_chunk;
      a.rec_sel = added(manyK, config(many, seq, C, 1, "selective"), Vn) / per_layer_chunk;
      // Saved sets on disk (whole sequences only): their transfers overlap compute, but on a machine whose
      // cores do the copying and the I/O they are not free; measured, as the other disk costs are.
      if (C == 0) a.act_disk = added(manyK, config(many, seq, C, 1, "all", "act"), Vn) / static_cast<double>(K);
    } else {
      a.block = per_seq1 / static_cast<double>(n_chunks);
    }
    a.head = std::max(0.0, per_seq1 / static_cast<double>(n_chunks) - a.block);
    cm.at[C > 0 ? C : c.seq] = a;
  }
  disk_rates(c.spill_dir.empty() ? scratch : c.spill_dir, &cm.disk_write_bps, &cm.disk_read_bps);
  return cm;
}

}  // namespace oomless
