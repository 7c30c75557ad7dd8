#include "plan/cost.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
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

// The model cut to L layers, as a config.json of its own (random init; an EOS id when it names none, which
// packing needs and timing does not).
std::string cut_model(const ModelConfig& cfg, int64_t L, const std::string& scratch) {
  json::Value j = cfg.to_json();
  j.set("num_hidden_layers", json::Value::integer(L));
  if (!cfg.eos_id) j.set("eos_token_id", json::Value::integer(0));
  const fs::path dir = fs::path(scratch) / ("plan-cut-" + std::to_string(L));
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << json::dump(j);
  return (dir / "config.json").string();
}

// Median seconds of the steps of `c` after setup (whose dry run warms the kernels) and one more step: at least
// `reps`, and more (up to 25) until they add up to a second, so that small models' differences rise above noise.
double time_steps(const TrainConfig& c, int64_t V, int reps) {
  Trainer t(c, "");
  const StepBatch b = synthetic_batch(c.batch * c.grad_accum, c.seq, V);
  t.step(b);
  std::vector<double> s;
  double total = 0;
  while (static_cast<int>(s.size()) < reps || (total < 1.0 && s.size() < 25)) {
    s.push_back(t.step(b).seconds);
    total += s.back();
  }
  std::sort(s.begin(), s.end());
  return s[s.size() / 2];
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
  const std::string one = cut_model(cfg, 1, scratch), many = cut_model(cfg, K, scratch);
  const double blocks = static_cast<double>(K - 1);
  const int reps = 3;
  const std::string spill = c.spill_dir.empty() ? scratch : c.spill_dir;
  // disk: "" or "optim" / "kv": that state on disk (in the run's spill folder) instead of memory.
  auto run = [&](const std::string& model, int64_t seq, int64_t chunk, int64_t batch, const char* policy,
                 const std::string& disk = "") {
    TrainConfig t = base;
    t.model = model, t.seq = seq, t.chunk = chunk, t.batch = batch, t.save_policy = policy;
    if (chunk > 0) t.page = c.page > 0 && chunk % c.page == 0 ? c.page : 0;
    if (disk == "optim") t.optim_state = "disk", t.spill_dir = spill;
    if (disk == "kv") t.kv_offload = "disk", t.spill_dir = spill;
    return time_steps(t, cfg.V, reps);
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
    const double t1 = run(one, seq, C, 1, "all"), t1b = run(one, seq, C, 2, "all");
    const double per_seq1 = std::max(0.0, t1b - t1), opt1 = std::max(0.0, t1 - per_seq1);
    if (cm.optim_per_param == 0) {
      const int64_t trained = trained_params(c, open_model(one, static_cast<uint64_t>(c.seed)).cfg);
      cm.optim_per_param = opt1 / static_cast<double>(std::max<int64_t>(trained, 1));
      // What keeping the state on disk adds to a step, as the engine streams it (measured, not modelled: the
      // page cache and the window's overlap decide it).
      cm.optim_disk_per_param = std::max(0.0, run(one, seq, C, 1, "all", "optim") - t1) /
                                static_cast<double>(std::max<int64_t>(trained, 1));
    }
    CostModel::AtT a;
    const double tK = blocks > 0 ? run(many, seq, C, 1, "all") : t1;
    const double per_layer_chunk = static_cast<double>(K) * static_cast<double>(n_chunks);
    if (C > 0) a.kv_disk = std::max(0.0, run(many, seq, C, 1, "all", "kv") - tK) / per_layer_chunk;
    if (blocks > 0) {
      a.block = std::max(0.0, tK - t1 - cm.optim_per_param * layer_p * blocks) / (blocks * static_cast<double>(n_chunks));
      a.rec_none = std::max(0.0, run(many, seq, C, 1, "none") - tK) / per_layer_chunk;
      a.rec_sel = std::max(0.0, run(many, seq, C, 1, "selective") - tK) / per_layer_chunk;
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
