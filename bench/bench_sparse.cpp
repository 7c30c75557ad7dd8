// Page-sparse attention against dense attention in chunk-recurrent training.
//
// retrieval: a long-range key-value retrieval task (generated here, seeded, written as .ids and read back):
// each sequence of T tokens is filler, with n key-value pairs somewhere in its first half (past the sink
// page) and, at its end, q queries (a key whose next token is its value) in rounds, each round every pair
// once in a random order. The first round can only be answered from the pairs far back ("far"); later
// rounds may also copy an earlier round. Only the query values are supervised. preset:micro, with RoPE
// theta 1e6 (--rope-theta; with 16-dim heads and the preset's 1e4, only one frequency pair turns by less
// than a radian over 4K positions, too few dimensions to match a key across the sequence), first learns
// the mechanism in a shared warm-up: the copy task (make_copy_sequence: every token of a repeated stretch
// supervised) on one-chunk sequences, 2000 steps of 8 x 256 tokens, then 300 steps of 1 x 4096 (the
// second stage teaches it to find a match 4K tokens back). From those weights it is trained dense and
// page-sparse (--k pages of --page tokens per query page, --sinks first pages, mean and minmax summaries)
// on the same retrieval sequences for the same steps; reported on held-out sequences, before and after:
// retrieval accuracy (argmax) on the first round and on every query, and the loss. Then the dense model is
// evaluated with sparse attention (each summary), with how often the page holding a first-round pair is
// among its query page's selection.
//
// speed: one chunk-recurrent training step of preset:tiny (random init, fp32) at each --T, dense and
// sparse; a dense step predicted (T^2 law through the measured dense steps) to exceed --time-box seconds
// is not run and is reported as extrapolated.
//
//   build/release/bench_sparse retrieval [--T 4096] [--chunk 1024] [--page 64] [--k 11] [--sinks 1]
//       [--steps 3000] [--lr 1e-3] [--pairs 32] [--queries 256] [--keys 64] [--values 64] [--batch 1]
//       [--rope-theta 1e6] [--warm-task copy|retrieval] [--warm-T 256,4096] [--warm-steps 2000,300]
//       [--warm-batch 8,1] [--warm-lr 3e-3] [--warm-pairs 8] [--warm-queries 48] [--warm-file F]
//       [--init F [--warm-steps 0]]
//       [--eval 32] [--runs dense,mean,minmax] [--ids PREFIX] [--save-dense F] [--threads N] [--json FILE]
//   build/release/bench_sparse speed [--T 32768,65536,131072] [--chunk 4096] [--page 64] [--k 128]
//       [--sinks 1] [--summary minmax|mean] [--dense yes|no] [--time-box 900] [--threads N] [--json FILE]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/cpu_info.h"
#include "data/text.h"
#include "io/json.h"
#include "memory/arena.h"
#include "model/config.h"
#include "model/model.h"
#include "kv/paged_kv.h"
#include "model/engine.h"
#include "plan/probe_timing.h"
#include "train/trainer.h"

using namespace oomless;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Flags {
  std::vector<std::string> args;
  std::string get(const std::string& name, const std::string& dflt) const {
    for (size_t i = 0; i + 1 < args.size(); ++i)
      if (args[i] == "--" + name) return args[i + 1];
    return dflt;
  }
  int64_t integer(const std::string& name, int64_t dflt) const { return std::stoll(get(name, std::to_string(dflt))); }
  double number(const std::string& name, double dflt) const { return std::stod(get(name, std::to_string(dflt))); }
};

std::vector<int64_t> int_list(const std::string& list) {
  std::vector<int64_t> out;
  for (size_t i = 0; i < list.size();) {
    size_t j = list.find(',', i);
    if (j == std::string::npos) j = list.size();
    out.push_back(std::stoll(list.substr(i, j - i)));
    i = j + 1;
  }
  return out;
}

void write_text(const std::string& path, const std::string& text) {
  std::FILE* fp = std::fopen(path.c_str(), "w");
  OOM_CHECK(fp && std::fwrite(text.data(), 1, text.size(), fp) == text.size() && std::fclose(fp) == 0,
            "[bench_sparse] cannot write ", path, " (does its folder exist and is it writable?)");
}

void write_json(const std::string& path, const json::Value& doc) { write_text(path, json::dump(doc) + "\n"); }

// ---------------------------------------------------------------------------------------------------------
// The retrieval task.

struct Task {
  int64_t T, C, P, pairs, queries;
  int32_t kKeys = 128, kVals = 128;  // how many distinct keys and values (--keys, --values; <= 1000)
  bool copy = false;                 // train on make_copy_sequence instead (the warm-up's --warm-task copy)
  // Token ranges of micro's vocabulary (8192): keys, values and filler are disjoint.
  static constexpr int32_t kKey0 = 1000, kVal0 = 2000, kFill0 = 3000, kFills = 4000;
};

struct Sequence {
  std::vector<int32_t> ids, targets;
  std::vector<int64_t> query_rows;  // positions whose target is a queried value
  std::vector<bool> first;          // per query: in the first round (only the far pairs answer it)
  std::vector<int64_t> pair_page;   // per query: the page holding its key-value pair
};

Sequence make_sequence(const Task& t, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Sequence s;
  s.ids.resize(static_cast<size_t>(t.T));
  s.targets.assign(static_cast<size_t>(t.T), -100);
  for (auto& x : s.ids) x = Task::kFill0 + static_cast<int32_t>(rng() % Task::kFills);
  std::vector<int32_t> keys(static_cast<size_t>(t.kKeys));
  for (int32_t i = 0; i < t.kKeys; ++i) keys[static_cast<size_t>(i)] = Task::kKey0 + i;
  std::shuffle(keys.begin(), keys.end(), rng);
  std::vector<int32_t> vals(static_cast<size_t>(t.pairs));
  for (auto& v : vals) v = Task::kVal0 + static_cast<int32_t>(rng() % static_cast<uint64_t>(t.kVals));
  // The pairs start past the sink page, anywhere in the first half.
  const int64_t lo = 2 * t.P, hi = t.T / 2 - 2 * t.pairs;
  const int64_t last_chunk = t.T - (t.T - 1) / t.C * t.C;
  OOM_CHECK(lo <= hi && 2 * t.queries < t.T / 2 && 2 * t.queries <= last_chunk,
            "[bench_sparse] the task does not fit T = ", t.T, ": ", t.pairs, " pairs must fit between position ", lo,
            " (two pages) and T/2, and ", t.queries, " queries in the last chunk and the second half");
  const int64_t off = lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(std::max<int64_t>(1, hi - lo)));
  for (int64_t i = 0; i < t.pairs; ++i) {
    s.ids[static_cast<size_t>(off + 2 * i)] = keys[static_cast<size_t>(i)];
    s.ids[static_cast<size_t>(off + 2 * i + 1)] = vals[static_cast<size_t>(i)];
  }
  // Queries in the last 2q positions (the last one's value is its target, past the sequence), in rounds.
  std::vector<int64_t> order;
  std::vector<int64_t> perm(static_cast<size_t>(t.pairs));
  for (int64_t i = 0; i < t.pairs; ++i) perm[static_cast<size_t>(i)] = i;
  while (static_cast<int64_t>(order.size()) < t.queries) {
    std::shuffle(perm.begin(), perm.end(), rng);
    order.insert(order.end(), perm.begin(), perm.end());
  }
  const int64_t q0 = t.T - 2 * t.queries + 1;
  for (int64_t j = 0; j < t.queries; ++j) {
    const int64_t p = order[static_cast<size_t>(j)], row = q0 + 2 * j;
    s.ids[static_cast<size_t>(row)] = keys[static_cast<size_t>(p)];
    if (row + 1 < t.T) s.ids[static_cast<size_t>(row + 1)] = vals[static_cast<size_t>(p)];
    s.targets[static_cast<size_t>(row)] = vals[static_cast<size_t>(p)];
    s.query_rows.push_back(row);
    s.first.push_back(j < t.pairs);
    s.pair_page.push_back((off + 2 * p) / t.P);
  }
  return s;
}

// The warm-up task that teaches the mechanism: random tokens (from the key, value and filler ranges), built
// left to right, where stretches of 2 to 32 tokens repeat an earlier stretch from anywhere before them;
// every token of a repeat but its last is supervised with the token after it, which can only be predicted by
// finding the earlier occurrence of the token and copying what followed it: the induction mechanism that
// retrieval needs, with a training signal at about a third of the positions instead of a few queries.
Sequence make_copy_sequence(int64_t T, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Sequence s;
  s.ids.resize(static_cast<size_t>(T));
  s.targets.assign(static_cast<size_t>(T), -100);
  const uint64_t span = static_cast<uint64_t>(Task::kFill0 + Task::kFills - Task::kKey0);
  for (auto& x : s.ids) x = Task::kKey0 + static_cast<int32_t>(rng() % span);
  int64_t pos = 16 + static_cast<int64_t>(rng() % 16);
  while (pos < T) {
    const int64_t len = std::min({T - pos, pos, 2 + static_cast<int64_t>(rng() % 31)});
    const int64_t src = static_cast<int64_t>(rng() % static_cast<uint64_t>(pos - len + 1));
    for (int64_t i = 0; i < len; ++i) s.ids[static_cast<size_t>(pos + i)] = s.ids[static_cast<size_t>(src + i)];
    for (int64_t i = 0; i + 1 < len; ++i)
      s.targets[static_cast<size_t>(pos + i)] = s.ids[static_cast<size_t>(pos + i + 1)];
    pos += len + 4 + static_cast<int64_t>(rng() % 32);  // random tokens between repeats
  }
  return s;
}

// The task as `.ids`: one sequence per line, its T ids and then the last query's value (T + 1 tokens), so
// a line alone gives every target (the token after each query row) and the pair's position (the key's
// first occurrence).
void write_ids(const std::string& path, const Task& t, int64_t n, uint64_t seed0) {
  std::string text;
  for (int64_t i = 0; i < n; ++i) {
    const Sequence s = make_sequence(t, seed0 + static_cast<uint64_t>(i));
    for (int32_t id : s.ids) text += std::to_string(id) + ' ';
    text += std::to_string(s.targets[static_cast<size_t>(s.query_rows.back())]) + '\n';
  }
  write_text(path, text);
}

std::vector<Sequence> read_task_ids(const std::string& path, const Task& t) {
  const std::vector<int32_t> all = read_ids_file(path, preset_config("micro").V);
  OOM_CHECK(all.size() % static_cast<size_t>(t.T + 1) == 0, "[bench_sparse] ", path, " does not hold lines of T + 1 = ",
            t.T + 1, " ids; write it again with this --T");
  std::vector<Sequence> out;
  for (size_t at = 0; at < all.size(); at += static_cast<size_t>(t.T + 1)) {
    const int32_t* line = all.data() + at;
    Sequence s;
    s.ids.assign(line, line + t.T);
    s.targets.assign(static_cast<size_t>(t.T), -100);
    const int64_t q0 = t.T - 2 * t.queries + 1;
    for (int64_t j = 0; j < t.queries; ++j) {
      const int64_t row = q0 + 2 * j;
      s.targets[static_cast<size_t>(row)] = line[row + 1];
      s.query_rows.push_back(row);
      s.first.push_back(j < t.pairs);
      const int64_t pair = std::find(line, line + t.T / 2, line[row]) - line;
      OOM_CHECK(pair < t.T / 2, "[bench_sparse] ", path, ": query ", j, " of line ", out.size() + 1,
                " has no pair in the first half; the file does not match --T/--pairs/--queries");
      s.pair_page.push_back(pair / t.P);
    }
    out.push_back(std::move(s));
  }
  return out;
}

struct Eval {
  double loss = 0, accuracy = 0, far_accuracy = 0;
  std::vector<double> hit_by_layer;  // first-round queries whose pair's page is selected
};

// Loss and argmax accuracy at the query rows of held-out sequences (every query is in the last chunk), and
// with a sparse store, per layer, how often the page holding a first-round query's pair is in the
// selection of the query's page.
Eval evaluate(Model& m, PagedKvStore& kv, const Task& t, const std::vector<Sequence>& data) {
  const ModelConfig& cfg = m.config();
  const int64_t nc = (t.T + t.C - 1) / t.C, last0 = (nc - 1) * t.C, Tc = t.T - last0;
  std::vector<float> logits(static_cast<size_t>(Tc * cfg.V));
  Eval e;
  e.hit_by_layer.assign(static_cast<size_t>(cfg.L), 0.0);
  int64_t hits = 0, total = 0, far_hits = 0, far = 0;
  double loss = 0;
  for (const Sequence& s : data) {
    const CeResult r = m.chunked_eval(Tensor(const_cast<int32_t*>(s.ids.data()), DType::i32, {t.T}),
                                      Tensor(const_cast<int32_t*>(s.targets.data()), DType::i32, {t.T}), t.C, kv);
    loss += r.loss_sum;
    m.logits(Tensor(logits.data(), DType::f32, {Tc, cfg.V}));
    for (size_t j = 0; j < s.query_rows.size(); ++j) {
      const float* row = logits.data() + (s.query_rows[j] - last0) * cfg.V;
      const bool ok = std::max_element(row, row + cfg.V) - row == s.targets[static_cast<size_t>(s.query_rows[j])];
      hits += ok;
      ++total;
      if (!s.first[j]) continue;
      far_hits += ok;
      ++far;
      for (int64_t l = 0; l < cfg.L; ++l) {
        const std::vector<int64_t> sel = kv.selection(l, nc - 1, (s.query_rows[j] - last0) / t.P);
        if (!sel.empty())
          e.hit_by_layer[static_cast<size_t>(l)] +=
              std::binary_search(sel.begin(), sel.end(), s.pair_page[j]) ? 1.0 : 0.0;
      }
    }
  }
  e.loss = loss / static_cast<double>(total);
  e.accuracy = static_cast<double>(hits) / static_cast<double>(total);
  e.far_accuracy = static_cast<double>(far_hits) / static_cast<double>(far);
  for (double& h : e.hit_by_layer) h /= static_cast<double>(far);
  return e;
}

struct Trained {
  std::string name;
  std::vector<double> losses;  // per step
  Eval eval;
  double seconds = 0;
};

PagedKvOptions store_options(const Flags& f, int64_t C, int64_t P, int64_t k, PageSummary sum) {
  PagedKvOptions o{C, P, KvOffload::none, std::string(1, '.')};
  o.sparse_pages = k, o.sink_pages = f.integer("sinks", 1), o.summary = sum;
  return o;
}

std::vector<std::vector<float>> snapshot(const ParamSet& p) {
  std::vector<std::vector<float>> s;
  for (const Tensor& t : p.tensors())
    s.emplace_back(static_cast<const float*>(t.data), static_cast<const float*>(t.data) + t.numel());
  return s;
}

void restore(ParamSet& p, const std::vector<std::vector<float>>& s) {
  for (size_t i = 0; i < s.size(); ++i) std::memcpy(p.tensors()[i].data, s[i].data(), s[i].size() * sizeof(float));
}

// A run of the shared Trainer on the task: preset:micro from the engine builder (random init with seed
// 42, then `start` when given), chunk-recurrent steps of t.C tokens, AdamW (no weight decay), clip 1.
std::unique_ptr<Trainer> make_trainer(const Flags& f, double rope_theta, const Task& t, int64_t k, PageSummary sum,
                                      int64_t steps, int64_t batch, double lr, const std::vector<std::vector<float>>& start,
                                      size_t budget) {
  TrainConfig c;
  c.model = "preset:micro";
  c.seed = 42;
  c.rope_theta = rope_theta;
  c.seq = t.T, c.chunk = t.C, c.page = t.P;
  c.sparse_pages = k, c.sink_pages = f.integer("sinks", 1), c.page_summary = page_summary_name(sum);
  c.batch = batch, c.steps = std::max<int64_t>(1, steps);
  c.lr = lr, c.min_lr = 0.1 * lr, c.weight_decay = 0, c.beta1 = 0.9, c.beta2 = 0.95, c.eps = 1e-8, c.clip = 1.0;
  c.save_policy = "none";
  c.budget = std::to_string(budget);
  auto tr = std::make_unique<Trainer>(c, "");
  if (!start.empty()) restore(*tr->engine().params, start);
  return tr;
}

// `steps` AdamW steps (warmup 50 steps, cosine to 10%), each over `batch` sequences with gradients
// accumulated; the mean query loss of every step.
std::vector<double> train_steps(Trainer& tr, const Task& t, int64_t steps, int64_t batch, double lr, uint64_t seed0,
                                const std::string& name, const std::vector<Sequence>* data = nullptr) {
  std::vector<double> losses;
  const double t0 = now();
  for (int64_t step = 1; step <= steps; ++step) {
    StepBatch sb;
    for (int64_t b = 0; b < batch; ++b) {
      const uint64_t seed = seed0 + static_cast<uint64_t>(step * batch + b);
      Sequence s = data ? (*data)[static_cast<size_t>((step - 1) * batch + b)]
                   : t.copy ? make_copy_sequence(t.T, seed) : make_sequence(t, seed);
      sb.ids.push_back(std::move(s.ids));
      sb.targets.push_back(std::move(s.targets));
    }
    const double warm = std::min(1.0, static_cast<double>(step) / 50.0);
    const double cosine = 0.5 * (1 + std::cos(M_PI * static_cast<double>(step) / static_cast<double>(steps)));
    const StepResult r = tr.step(sb, lr * warm * (0.1 + 0.9 * cosine));
    losses.push_back(r.loss);
    if (step % 100 == 0 || step == steps) {
      double avg = 0;
      for (int64_t i = std::max<int64_t>(0, step - 100); i < step; ++i) avg += losses[static_cast<size_t>(i)];
      std::printf("  %-14s step %5lld: loss (mean of the last 100) %.4f  (%.0f s)\n", name.c_str(),
                  static_cast<long long>(step), avg / static_cast<double>(std::min<int64_t>(100, step)), now() - t0);
      std::fflush(stdout);
    }
  }
  return losses;
}

// Parameters as raw f32 in ParamSet order (the warm-up's --warm-file / --init, --save-dense).
void save_weights(const std::string& path, const std::vector<std::vector<float>>& w) {
  std::FILE* fp = std::fopen(path.c_str(), "wb");
  bool ok = fp != nullptr;
  for (const auto& v : w) ok = ok && std::fwrite(v.data(), sizeof(float), v.size(), fp) == v.size();
  OOM_CHECK(ok && std::fclose(fp) == 0, "[bench_sparse] cannot write ", path);
}

void load_weights(const std::string& path, std::vector<std::vector<float>>& w) {
  std::FILE* fp = std::fopen(path.c_str(), "rb");
  OOM_CHECK(fp, "[bench_sparse] cannot open ", path);
  bool ok = true;
  for (auto& v : w) ok = ok && std::fread(v.data(), sizeof(float), v.size(), fp) == v.size();
  std::fclose(fp);
  OOM_CHECK(ok, "[bench_sparse] ", path, " is shorter than preset:micro's parameters (write it with --warm-file)");
}

int retrieval(const Flags& f) {
  Task t{f.integer("T", 4096), f.integer("chunk", 1024), f.integer("page", 64), f.integer("pairs", 32),
         f.integer("queries", 256)};
  t.kKeys = static_cast<int32_t>(std::clamp<int64_t>(f.integer("keys", 64), t.pairs, 1000));
  t.kVals = static_cast<int32_t>(std::clamp<int64_t>(f.integer("values", 64), 2, 1000));
  const int64_t k = f.integer("k", 11), steps = f.integer("steps", 3000), n_eval = f.integer("eval", 32);
  const double lr = f.number("lr", 1e-3);
  ModelConfig cfg = preset_config("micro");
  cfg.rope.theta = f.number("rope-theta", 1e6);  // see the top of the file
  const int64_t nc = (t.T + t.C - 1) / t.C, hist = (nc - 1) * t.C / t.P, sinks = f.integer("sinks", 1);
  std::printf("retrieval: preset:micro (RoPE theta %g), T %lld, chunk %lld, page %lld; %lld pairs, %lld queries; %lld steps, lr %g; "
              "sparse: %lld + %lld sink of the last chunk's %lld earlier pages (%.1f%%); %d threads\n",
              cfg.rope.theta, static_cast<long long>(t.T), static_cast<long long>(t.C), static_cast<long long>(t.P),
              static_cast<long long>(t.pairs), static_cast<long long>(t.queries), static_cast<long long>(steps), lr,
              static_cast<long long>(k), static_cast<long long>(sinks), static_cast<long long>(hist),
              100.0 * static_cast<double>(k + sinks) / static_cast<double>(hist), get_threads());
  std::fflush(stdout);
  struct Run {
    std::string name;
    int64_t k;
    PageSummary sum;
  };
  const std::vector<Run> runs = {{"dense", 0, PageSummary::mean},
                                 {"sparse mean", k, PageSummary::mean},
                                 {"sparse minmax", k, PageSummary::minmax}};
  json::Value results = json::Value::array();
  const std::string only = f.get("runs", "dense,mean,minmax");
  const int64_t batch = f.integer("batch", 1);
  // Optional warm-up shared by every run, in stages (comma lists --warm-T, --warm-steps, --warm-batch; a
  // single value applies to every stage): one-chunk sequences (dense and sparse are the same there) of the
  // copy task (--warm-task copy, the default) or of the retrieval task itself; the runs start from its
  // weights. --init F starts from weights saved by --warm-file F of an earlier run instead of the random init.
  const std::vector<int64_t> warm_Ts = int_list(f.get("warm-T", "256,4096")), warm_steps = int_list(f.get("warm-steps", "2000,300")),
                             warm_batches = int_list(f.get("warm-batch", "8,1"));
  const double warm_lr = f.number("warm-lr", 3e-3);
  const size_t n_stages = std::max({warm_Ts.size(), warm_steps.size(), warm_batches.size()});
  auto stage_value = [&](const std::vector<int64_t>& v, size_t i) { return v[std::min(i, v.size() - 1)]; };
  std::vector<std::vector<float>> start;
  json::Value warm_json = json::Value::array();
  const std::string init_file = f.get("init", ""), warm_file = f.get("warm-file", "");
  if (!init_file.empty()) {
    CpuMemory mem(size_t{1} << 30);
    ParamSet params(cfg, DType::f32, mem.device, Category::weights);
    start = snapshot(params);
    load_weights(init_file, start);
    std::printf("init: %s\n", init_file.c_str());
  }
  if (stage_value(warm_steps, 0) > 0) {
    for (size_t st = 0; st < n_stages; ++st) {
      Task w{stage_value(warm_Ts, st), 0, t.P, f.integer("warm-pairs", 8), f.integer("warm-queries", 48), t.kKeys,
             t.kVals};
      w.C = w.T;
      w.copy = f.get("warm-task", "copy") == "copy";
      w.P = std::min(t.P, w.T / 8);  // one chunk: the page only places the pairs (past two pages)
      const int64_t n_steps = stage_value(warm_steps, st), wb = stage_value(warm_batches, st);
      // Each stage continues from the last one's weights.
      std::unique_ptr<Trainer> tr = make_trainer(f, cfg.rope.theta, w, 0, PageSummary::mean, n_steps, wb, warm_lr,
                                                 start, size_t{8} << 30);
      Model& m = *tr->engine().model;
      PagedKvStore& kv = *tr->kv();
      const double t0 = now();
      const std::vector<double> losses = train_steps(*tr, w, n_steps, wb, warm_lr, 500000000 + 10000000 * st,
                                                     "warm-up " + std::to_string(st + 1));
      std::vector<Sequence> held_out;
      for (int64_t i = 0; i < n_eval; ++i) held_out.push_back(make_sequence(w, 8000000 + static_cast<uint64_t>(i)));
      const Eval e = evaluate(m, kv, w, held_out);
      std::printf("warm-up stage %zu (%s task, T %lld, batch %lld, %lld steps): retrieval at T %lld (%lld pairs, "
                  "%lld queries), held-out accuracy first round %.1f%%, all %.1f%%; %.0f s\n", st + 1,
                  w.copy ? "copy" : "retrieval", static_cast<long long>(w.T), static_cast<long long>(wb),
                  static_cast<long long>(n_steps), static_cast<long long>(w.T), static_cast<long long>(w.pairs),
                  static_cast<long long>(w.queries), 100 * e.far_accuracy, 100 * e.accuracy, now() - t0);
      std::fflush(stdout);
      json::Value stage = json::Value::object();
      stage.set("task", json::Value::string(w.copy ? "copy" : "retrieval"));
      stage.set("T", json::Value::integer(w.T));
      stage.set("steps", json::Value::integer(n_steps));
      stage.set("batch", json::Value::integer(wb));
      stage.set("lr", json::Value::number(warm_lr));
      stage.set("eval_pairs", json::Value::integer(w.pairs));
      stage.set("eval_queries", json::Value::integer(w.queries));
      stage.set("far_accuracy", json::Value::number(e.far_accuracy));
      stage.set("accuracy", json::Value::number(e.accuracy));
      stage.set("seconds", json::Value::number(now() - t0));
      warm_json.push_back(std::move(stage));
      start = snapshot(*tr->engine().params);
    }
    if (!warm_file.empty()) save_weights(warm_file, start);  // for later runs (--init F --warm-steps 0)
  }
  // The task's sequences as .ids (written, then read back: the runs train and evaluate on the files).
  const std::string prefix = f.get("ids", "retrieval-T" + std::to_string(t.T));
  write_ids(prefix + "-train.ids", t, steps * batch, 1000000);
  write_ids(prefix + "-eval.ids", t, n_eval, 7000000);
  const std::vector<Sequence> train_data = read_task_ids(prefix + "-train.ids", t);
  const std::vector<Sequence> eval_data = read_task_ids(prefix + "-eval.ids", t);
  std::printf("task: %s-train.ids (%zu sequences), %s-eval.ids (%zu)\n", prefix.c_str(), train_data.size(),
              prefix.c_str(), eval_data.size());
  for (const Run& run : runs) {
    const std::string tag = run.k == 0 ? "dense" : page_summary_name(run.sum);
    if (("," + only + ",").find("," + tag + ",") == std::string::npos) continue;
    std::unique_ptr<Trainer> trainer = make_trainer(f, cfg.rope.theta, t, run.k, run.sum, steps, batch, lr, start,
                                                    size_t{16} << 30);
    Engine& eng = trainer->engine();
    Model& m = *eng.model;
    PagedKvStore& kv = *trainer->kv();
    Trained tr;
    tr.name = run.name;
    const Eval before = evaluate(m, kv, t, eval_data);
    std::printf("%-14s before training: held-out accuracy first round (far) %.1f%%, all %.1f%%; loss %.4f\n",
                run.name.c_str(), 100 * before.far_accuracy, 100 * before.accuracy, before.loss);
    std::fflush(stdout);
    const double t0 = now();
    tr.losses = train_steps(*trainer, t, steps, batch, lr, 0, run.name, &train_data);
    tr.seconds = now() - t0;
    tr.eval = evaluate(m, kv, t, eval_data);
    std::printf("%-14s held-out accuracy: first round (far) %.1f%%, all queries %.1f%%; loss %.4f; %.0f s\n",
                run.name.c_str(), 100 * tr.eval.far_accuracy, 100 * tr.eval.accuracy, tr.eval.loss, tr.seconds);
    json::Value o = json::Value::object();
    o.set("name", json::Value::string(run.name));
    o.set("sparse_pages", json::Value::integer(run.k));
    o.set("summary", json::Value::string(page_summary_name(run.sum)));
    o.set("far_accuracy", json::Value::number(tr.eval.far_accuracy));
    o.set("accuracy", json::Value::number(tr.eval.accuracy));
    o.set("eval_loss", json::Value::number(tr.eval.loss));
    o.set("far_accuracy_before", json::Value::number(before.far_accuracy));
    o.set("accuracy_before", json::Value::number(before.accuracy));
    o.set("eval_loss_before", json::Value::number(before.loss));
    double last = 0;
    const int64_t tail = std::min<int64_t>(100, steps);
    for (int64_t i = steps - tail; i < steps; ++i) last += tr.losses[static_cast<size_t>(i)];
    if (tail > 0) o.set("train_loss_last100", json::Value::number(last / static_cast<double>(tail)));
    o.set("seconds", json::Value::number(tr.seconds));
    if (run.k == 0 && f.get("save-dense", "") != "") save_weights(f.get("save-dense", ""), snapshot(*eng.params));
    if (run.k == 0) {
      // The dense model read through sparse attention: how well each summary finds the pairs' pages.
      json::Value probe = json::Value::array();
      for (PageSummary sum : {PageSummary::mean, PageSummary::minmax}) {
        PagedKvStore skv(kv_dims(cfg), *eng.ops, eng.mem->device, eng.mem->host, store_options(f, t.C, t.P, k, sum), t.T, false);
        const Eval e = evaluate(m, skv, t, eval_data);
        std::printf("  dense model, sparse %s attention: accuracy far %.1f%%, all %.1f%%, loss %.4f; far pair's page "
                    "selected by layer:", page_summary_name(sum), 100 * e.far_accuracy, 100 * e.accuracy, e.loss);
        json::Value hits = json::Value::array();
        for (double h : e.hit_by_layer) {
          std::printf(" %.1f%%", 100 * h);
          hits.push_back(json::Value::number(h));
        }
        std::printf("\n");
        json::Value p = json::Value::object();
        p.set("summary", json::Value::string(page_summary_name(sum)));
        p.set("far_accuracy", json::Value::number(e.far_accuracy));
        p.set("accuracy", json::Value::number(e.accuracy));
        p.set("eval_loss", json::Value::number(e.loss));
        p.set("pair_page_selected_by_layer", std::move(hits));
        probe.push_back(std::move(p));
      }
      o.set("dense_model_read_sparse", std::move(probe));
    }
    results.push_back(std::move(o));
    std::fflush(stdout);
  }
  if (f.get("json", "") != "") {
    json::Value doc = json::Value::object();
    doc.set("task", json::Value::string("retrieval"));
    doc.set("T", json::Value::integer(t.T));
    doc.set("chunk", json::Value::integer(t.C));
    doc.set("page", json::Value::integer(t.P));
    doc.set("pairs", json::Value::integer(t.pairs));
    doc.set("queries", json::Value::integer(t.queries));
    doc.set("sparse_pages", json::Value::integer(k));
    doc.set("sink_pages", json::Value::integer(sinks));
    doc.set("history_pages_last_chunk", json::Value::integer(hist));
    doc.set("steps", json::Value::integer(steps));
    doc.set("batch", json::Value::integer(batch));
    doc.set("keys", json::Value::integer(t.kKeys));
    doc.set("values", json::Value::integer(t.kVals));
    doc.set("warm_up", std::move(warm_json));
    doc.set("lr", json::Value::number(lr));
    doc.set("rope_theta", json::Value::number(cfg.rope.theta));
    doc.set("ids", json::Value::string(prefix));
    doc.set("threads", json::Value::integer(get_threads()));
    doc.set("runs", std::move(results));
    write_json(f.get("json", ""), doc);
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------------------
// Step time.

double one_step(const ModelConfig& cfg, int64_t T, int64_t C, const PagedKvOptions& o) {
  EngineOptions eo;
  eo.model = "preset:tiny";
  eo.seed = 1;
  eo.budget = size_t{20} << 30;
  eo.save_policy = "none";
  Engine e = build_engine(eo);
  Model& m = *e.model;
  m.reserve(C, true, true);
  PagedKvStore kv(kv_dims(cfg), *e.ops, e.mem->device, e.mem->host, o, T, true);
  std::vector<int32_t> ids(static_cast<size_t>(T)), tg(static_cast<size_t>(T));
  std::mt19937_64 rng(2);
  for (auto& x : ids) x = static_cast<int32_t>(rng() % static_cast<uint64_t>(cfg.V));
  for (int64_t t = 0; t < T; ++t) tg[static_cast<size_t>(t)] = t + 1 < T ? ids[static_cast<size_t>(t + 1)] : -100;
  const double t0 = now();
  m.chunked_step(Tensor(ids.data(), DType::i32, {T}), Tensor(tg.data(), DType::i32, {T}), C, kv,
                 1.0 / static_cast<double>(T - 1));
  return now() - t0;
}

int speed(const Flags& f) {
  const std::vector<int64_t> Ts = int_list(f.get("T", "32768,65536,131072"));
  const int64_t C = f.integer("chunk", 4096), P = f.integer("page", 64), k = f.integer("k", 128);
  const PageSummary summary = parse_page_summary(f.get("summary", "minmax"));
  const bool run_dense = f.get("dense", "yes") != "no";  // no: the sparse steps only
  const double box = f.number("time-box", 900);
  const ModelConfig cfg = preset_config("tiny");
  std::printf("speed: preset:tiny fp32, one chunk-recurrent step, chunk %lld, page %lld; sparse %lld + %lld sink "
              "pages (%lld tokens); time box %.0f s; %d threads\n",
              static_cast<long long>(C), static_cast<long long>(P), static_cast<long long>(k),
              static_cast<long long>(f.integer("sinks", 1)), static_cast<long long>(k * P), box, get_threads());
  std::printf("%8s %12s %12s %9s  %s\n", "T", "dense s", "sparse s", "speedup", "dense");
  std::fflush(stdout);
  std::vector<std::pair<double, double>> dense_pts;  // (T, s)
  json::Value rows = json::Value::array();
  for (int64_t T : Ts) {
    // Dense: a + b T^2 through the measured points (one point: b from the step's attention share, assumed 1/2).
    double predicted = -1;
    if (!dense_pts.empty()) {
      double a = 0, b = 0;
      if (dense_pts.size() == 1) {
        const auto [t1, s1] = dense_pts[0];
        b = 0.5 * s1 / (t1 * t1);
        a = 0.5 * s1 / t1;
      } else {
        const auto [t1, s1] = dense_pts[dense_pts.size() - 2];
        const auto [t2, s2] = dense_pts.back();
        // s = a T + b T^2 through both points.
        b = (s2 / t2 - s1 / t1) / (t2 - t1);
        a = s1 / t1 - b * t1;
      }
      predicted = a * static_cast<double>(T) + b * static_cast<double>(T) * static_cast<double>(T);
    }
    double dense = predicted;
    const bool measured = run_dense && (predicted < 0 || predicted <= box);
    if (measured) {
      dense = one_step(cfg, T, C, store_options(f, C, P, 0, PageSummary::mean));
      dense_pts.push_back({static_cast<double>(T), dense});
    }
    const double sparse = one_step(cfg, T, C, store_options(f, C, P, k, summary));
    std::printf("%8lld %12.1f %12.1f %8.2fx  %s\n", static_cast<long long>(T), dense, sparse, dense / sparse,
                measured ? "measured" : run_dense ? "extrapolated (T^2 law through the measured dense steps)"
                                                  : "not run (--dense no)");
    std::fflush(stdout);
    json::Value r = json::Value::object();
    r.set("T", json::Value::integer(T));
    r.set("dense_s", json::Value::number(dense));
    r.set("dense", json::Value::string(measured ? "measured" : run_dense ? "extrapolated" : "not run"));
    r.set("sparse_s", json::Value::number(sparse));
    r.set("speedup", json::Value::number(dense / sparse));
    rows.push_back(std::move(r));
  }
  if (f.get("json", "") != "") {
    json::Value doc = json::Value::object();
    doc.set("task", json::Value::string("speed"));
    doc.set("chunk", json::Value::integer(C));
    doc.set("page", json::Value::integer(P));
    doc.set("sparse_pages", json::Value::integer(k));
    doc.set("summary", json::Value::string(page_summary_name(summary)));
    doc.set("threads", json::Value::integer(get_threads()));
    doc.set("rows", std::move(rows));
    write_json(f.get("json", ""), doc);
  }
  return 0;
}

}  // namespace

int run_main(int argc, char** argv) {
  Flags f;
  for (int i = 2; i < argc; ++i) f.args.push_back(argv[i]);
  const std::string what = argc > 1 ? argv[1] : "";
  if (f.get("threads", "") != "") set_threads(static_cast<int>(f.integer("threads", 0)));
  if (what == "retrieval") return retrieval(f);
  if (what == "speed") return speed(f);
  std::fprintf(stderr, "usage: bench_sparse retrieval|speed [flags] (see the top of bench/bench_sparse.cpp)\n");
  return 2;
}

int main(int argc, char** argv) {
  try {
    return run_main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_sparse: %s\n", e.what());
    return 1;
  }
}
