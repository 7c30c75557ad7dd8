#include "plan/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "memory/arena.h"
#include "model/lora.h"
#include "plan/milp.h"

namespace oomless {

namespace fs = std::filesystem;

namespace {

constexpr SavePolicy kPolicies[3] = {SavePolicy::all, SavePolicy::selective, SavePolicy::none};
constexpr double kMiB = 1024.0 * 1024.0;

// "none:0-3,selective:4,all:5-7" (or one word when every layer agrees), layers laid out as solve_plan does.
std::string policy_spec(const std::vector<SavePolicy>& p) {
  std::string out;
  for (size_t i = 0; i < p.size();) {
    size_t j = i;
    while (j + 1 < p.size() && p[j + 1] == p[i]) ++j;
    if (i == 0 && j + 1 == p.size()) return save_policy_name(p[i]);
    if (!out.empty()) out += ',';
    out += save_policy_name(p[i]);
    out += ':';
    out += std::to_string(i);
    if (j > i) out += '-', out += std::to_string(j);
    i = j + 1;
  }
  return out;
}

// Choices from counts: the sets on disk first (all, then selective), then none, selective, all in memory.
void lay_out(int64_t L, const int64_t disk[2], const int64_t mem[3], std::vector<SavePolicy>* p, std::vector<bool>* d) {
  p->clear(), d->clear();
  for (int k = 0; k < 2; ++k)
    for (int64_t i = 0; i < disk[k]; ++i) p->push_back(k == 0 ? SavePolicy::all : SavePolicy::selective), d->push_back(true);
  for (SavePolicy x : {SavePolicy::none, SavePolicy::selective, SavePolicy::all})
    for (int64_t i = 0; i < mem[static_cast<int>(x)]; ++i) p->push_back(x), d->push_back(false);
  OOM_CHECK(static_cast<int64_t>(p->size()) == L, "[plan] the layer counts do not add up");
}

// "disk:0-3,none" for per-layer places (or "none" / "disk" when every layer agrees).
std::string tier_spec(const std::vector<bool>& d) {
  std::string out;
  for (size_t i = 0; i < d.size();) {
    size_t j = i;
    while (j + 1 < d.size() && d[j + 1] == d[i]) ++j;
    if (i == 0 && j + 1 == d.size()) return d[i] ? "disk" : "none";
    if (d[i]) {
      if (!out.empty()) out += ',';
      out += "disk:" + std::to_string(i);
      if (j > i) out += '-' + std::to_string(j);
    }
    i = j + 1;
  }
  return out + (out.empty() ? "" : ",") + "none";
}

// The spill folder a configuration needs: kept (or "." for an estimate) when something goes to disk, dropped
// otherwise (a --spill-dir with nothing on disk is refused).
TrainConfig spill_for(TrainConfig c, const std::string& folder) {
  const bool disk = c.act_offload == "disk" || c.kv_offload == "disk" || c.optim_state == "disk";
  c.spill_dir = disk ? (c.spill_dir.empty() ? folder : c.spill_dir) : "";
  return c;
}

TrainConfig with_global(TrainConfig c, const PlanGlobal& g) {
  c.chunk = g.chunk;
  c.act_offload = g.act_offload;
  c.kv_offload = g.kv_offload;
  c.optim_state = g.optim_state;
  if (g.chunk == 0) c.page = 0, c.sparse_pages = 0;
  return c;
}


}  // namespace

std::string PlanGlobal::flags() const {
  std::string f;
  auto add = [&](const std::string& x) { f += (f.empty() ? "" : " ") + x; };
  if (chunk > 0) add("--chunk " + std::to_string(chunk));
  if (act_offload != "none") add("--act-offload " + act_offload);
  if (kv_offload != "none") add("--kv-offload " + kv_offload);
  if (optim_state != "host") add("--optim-state " + optim_state);
  return f;
}

const std::vector<std::string>& planned_flags() {
  static const std::vector<std::string> f = {"save-policy", "act-offload", "chunk", "page", "kv-offload", "optim-state"};
  return f;
}

double PlanInstance::bytes(size_t o, const std::vector<SavePolicy>& p, const std::vector<bool>& on_disk) const {
  const Option& x = options[o];
  double sum = 0, most = 0;
  for (size_t l = 0; l < p.size(); ++l) {
    const size_t k = static_cast<size_t>(p[l]);
    if (x.disk_allowed && on_disk[l]) most = std::max(most, x.set_bytes[k]);
    else sum += x.act_bytes[k];
  }
  return x.base_bytes + sum + 2 * most;
}

double PlanInstance::seconds(size_t o, const std::vector<SavePolicy>& p, const std::vector<bool>& on_disk) const {
  const Option& x = options[o];
  double rec = 0, io = 0;
  for (size_t l = 0; l < p.size(); ++l) {
    const size_t k = static_cast<size_t>(p[l]);
    rec += x.rec_seconds[k];
    if (x.disk_allowed && on_disk[l]) io += x.set_bytes[k] * x.disk_seconds_per_byte, rec += x.disk_seconds[k];
  }
  return std::max(x.base_seconds + rec, x.io_seconds + io);
}

PlanPick solve_plan(const PlanInstance& in) {
  const int64_t L = in.L;
  const size_t G = in.options.size();
  OOM_CHECK(L >= 1 && G >= 1, "[plan] an empty instance");
  // Bytes in MiB and seconds in milliseconds keep the coefficients within a few orders of magnitude.
  const double B = in.budget / kMiB;
  double m_mem = 1, m_t = 1;
  for (const auto& o : in.options) {
    const double a = std::max(*std::max_element(o.act_bytes.begin(), o.act_bytes.end()),
                              *std::max_element(o.set_bytes.begin(), o.set_bytes.end())) / kMiB;
    const double r = (*std::max_element(o.rec_seconds.begin(), o.rec_seconds.end()) +
                      *std::max_element(o.disk_seconds.begin(), o.disk_seconds.end())) * 1e3;
    m_mem = std::max(m_mem, o.base_bytes / kMiB + static_cast<double>(L + 2) * a - B + 1);
    m_t = std::max(m_t, o.base_seconds * 1e3 + static_cast<double>(L) * r +
                            o.io_seconds * 1e3 + static_cast<double>(L) * a * kMiB * o.disk_seconds_per_byte * 1e3 + 1);
  }
  // Layers are alike (the same shape, so the same bytes and seconds per choice): the program counts them,
  // n[policy][place] layers in each state (place 0 memory, 1 disk; a layer at none keeps nothing to send), and
  // lay_out places them. Binaries per layer instead made every permutation of the layers an optimum of its own,
  // which branch and bound had to tell apart (one SmolLM2 instance ran for more than half an hour).
  Milp m;
  std::array<std::array<int, 2>, 3> n{};
  Milp::Terms layers;
  for (int p = 0; p < 3; ++p)
    for (int t = 0; t < 2; ++t) {
      int& v = n[static_cast<size_t>(p)][static_cast<size_t>(t)];
      v = -1;
      if (t == 1 && kPolicies[p] == SavePolicy::none) continue;
      std::string name = "n_";
      name += save_policy_name(kPolicies[p]);
      if (t == 1) name += "_disk";
      v = m.integer(std::move(name), 0, static_cast<int>(L));
      layers.push_back({v, 1.0});
    }
  m.row(layers, static_cast<double>(L), static_cast<double>(L));
  // z[policy]: some layer at that policy sends its set to disk (then the ring holds two of its sets).
  std::array<int, 2> z{};
  for (int p = 0; p < 2; ++p) {
    std::string name = "z_";
    name += save_policy_name(kPolicies[p]);
    z[static_cast<size_t>(p)] = m.binary(std::move(name));
    m.row({{n[static_cast<size_t>(p)][1], 1.0}, {z[static_cast<size_t>(p)], -static_cast<double>(L)}}, -Milp::kInf, 0);
  }
  std::vector<int> y(G);
  Milp::Terms pick;
  for (size_t g = 0; g < G; ++g) y[g] = m.binary("y_" + std::to_string(g)), pick.push_back({y[g], 1.0});
  m.row(pick, 1, 1);
  const int t = m.continuous("t_ms", 0);
  for (size_t g = 0; g < G; ++g) {
    const auto& o = in.options[g];
    Milp::Terms mem{{y[g], m_mem}}, time{{t, 1.0}, {y[g], -m_t}}, io{{t, 1.0}, {y[g], -m_t}};
    int r = -1;
    if (o.disk_allowed) {
      r = m.continuous("ring_" + std::to_string(g), 0);
      mem.push_back({r, 2.0});
      for (int p = 0; p < 2; ++p)  // r >= a set of policy p when some layer at p goes to disk
        m.row({{r, 1.0}, {z[static_cast<size_t>(p)], -o.set_bytes[static_cast<size_t>(p)] / kMiB}}, 0, Milp::kInf);
    }
    for (int p = 0; p < 3; ++p)
      for (int tt = 0; tt < 2; ++tt) {
        const int v = n[static_cast<size_t>(p)][static_cast<size_t>(tt)];
        if (v < 0) continue;
        const double a = o.act_bytes[static_cast<size_t>(p)] / kMiB, sb = o.set_bytes[static_cast<size_t>(p)] / kMiB;
        double sec = o.rec_seconds[static_cast<size_t>(p)];
        if (tt == 1 && o.disk_allowed) {
          io.push_back({v, -sb * kMiB * o.disk_seconds_per_byte * 1e3});
          sec += o.disk_seconds[static_cast<size_t>(p)];
        } else {
          mem.push_back({v, a});
        }
        time.push_back({v, -sec * 1e3});
      }
    m.row(mem, -Milp::kInf, B - o.base_bytes / kMiB + m_mem);   // memory <= budget when y[g]
    m.row(time, o.base_seconds * 1e3 - m_t, Milp::kInf);        // t >= compute when y[g]
    m.row(io, o.io_seconds * 1e3 - m_t, Milp::kInf);             // t >= transfers when y[g]
  }
  m.minimize({{t, 1.0}});
  const Milp::Solution s = m.solve();
  PlanPick out;
  out.solver = s.status;
  if (!s.feasible) return out;
  out.feasible = true;
  for (size_t g = 0; g < G; ++g)
    if (s.x[static_cast<size_t>(y[g])] > 0.5) out.option = g;
  const bool disk = in.options[out.option].disk_allowed;
  int64_t on_disk[3] = {0, 0, 0}, in_mem[3] = {0, 0, 0};  // on_disk[none] stays 0
  for (int p = 0; p < 3; ++p)
    for (int tt = 0; tt < 2; ++tt) {
      const int v = n[static_cast<size_t>(p)][static_cast<size_t>(tt)];
      if (v < 0) continue;
      const int64_t k = std::llround(s.x[static_cast<size_t>(v)]);
      if (tt == 1 && disk) on_disk[p] += k;
      else in_mem[p] += k;
    }
  lay_out(L, on_disk, in_mem, &out.policies, &out.on_disk);
  out.seconds = in.seconds(out.option, out.policies, out.on_disk);
  out.bytes = in.bytes(out.option, out.policies, out.on_disk);
  return out;
}

PlanPick enumerate_plan(const PlanInstance& in) {
  OOM_CHECK(in.L >= 1 && in.L <= 8, "[plan] enumeration is for instances of at most 8 layers, got ", in.L);
  PlanPick best;
  best.solver = "enumeration";
  // Each layer: all, selective, none in memory; all, selective on disk (5 states).
  int64_t n = 1;
  for (int64_t l = 0; l < in.L; ++l) n *= 5;
  std::vector<SavePolicy> p(static_cast<size_t>(in.L));
  std::vector<bool> d(static_cast<size_t>(in.L));
  for (size_t o = 0; o < in.options.size(); ++o)
    for (int64_t code = 0; code < n; ++code) {
      int64_t c = code;
      bool skip = false;
      for (int64_t l = 0; l < in.L; ++l, c /= 5) {
        const int st = static_cast<int>(c % 5);
        p[static_cast<size_t>(l)] = kPolicies[st < 3 ? st : st - 3];
        d[static_cast<size_t>(l)] = st >= 3;
        skip = skip || (st >= 3 && !in.options[o].disk_allowed);
      }
      if (skip) continue;
      const double b = in.bytes(o, p, d);
      if (b > in.budget) continue;
      const double s = in.seconds(o, p, d);
      if (!best.feasible || s < best.seconds) best = {true, o, p, d, s, b, "enumeration"};
    }
  return best;
}

PlanInstance build_instance(const TrainConfig& c, const ModelSource& src, size_t budget, const CostModel& cost,
                            const std::vector<int64_t>& chunks) {
  const ModelConfig& cfg = src.cfg;
  const int64_t L = cfg.L;
  const std::unique_ptr<Ops> ops = make_ops("cpu");
  PlanInstance in;
  in.L = L;
  in.budget = static_cast<double>(budget);
  const double n_seq = static_cast<double>(c.batch * c.grad_accum);
  const double dsb = 1.0 / std::max(1.0, cost.disk_write_bps) + 1.0 / std::max(1.0, cost.disk_read_bps);
  const double opt_s = cost.optim_per_param * static_cast<double>(trained_params(c, cfg));
  std::vector<PlanGlobal> globals;
  std::vector<int64_t> Ts = chunks;
  if (c.chunk == 0 || c.chunk >= c.seq) Ts.insert(Ts.begin(), c.seq);
  for (int64_t T : Ts) {
    const int64_t chunk = T == c.seq ? 0 : T;
    for (const char* opt : {"host", "disk"}) {
      if (chunk == 0) {
        globals.push_back({0, "none", "none", opt});  // each layer's set in memory or on disk
      } else {
        globals.push_back({chunk, "none", "none", opt});
        globals.push_back({chunk, "none", "disk", opt});
      }
    }
  }
  for (const PlanGlobal& g : globals) {
    const TrainConfig gc = with_global(c, g);
    PlanInstance::Option o;
    o.g = g;
    const auto found = cost.at.find(g.chunk == 0 ? c.seq : g.chunk);
    const CostModel::AtT at = found == cost.at.end() ? CostModel::AtT{} : found->second;  // memory only: no times
    auto ram = [&](const char* policy) {
      TrainConfig x = gc;
      x.save_policy = policy;
      if (std::string(policy) == "none") x.act_offload = "none";  // nothing to offload
      return estimate_training(spill_for(x, "."), src, *ops);
    };
    const MemoryEstimate none = ram("none");
    o.base_bytes = static_cast<double>(none.ram_peak());
    o.disk_allowed = g.chunk == 0;
    for (int p = 0; p < 2; ++p) {
      const MemoryEstimate e = ram(save_policy_name(kPolicies[p]));
      o.act_bytes[static_cast<size_t>(p)] = (static_cast<double>(e.ram_peak()) - o.base_bytes) / static_cast<double>(L);
      // A ring set: the layer's tensors each on a 64-byte boundary (at most 64 bytes more per tensor).
      o.set_bytes[static_cast<size_t>(p)] =
          static_cast<double>(e.layer_activations[0][static_cast<size_t>(kPolicies[p])]) + 64.0 * 24;
    }
    const double pieces = g.chunk == 0 ? 1.0 : static_cast<double>(c.seq) / static_cast<double>(g.chunk);
    o.base_seconds = n_seq * pieces * (static_cast<double>(L) * at.block + at.head) + opt_s;
    if (g.optim_state == "disk") o.base_seconds += cost.optim_disk_per_param * static_cast<double>(trained_params(c, cfg));
    if (g.kv_offload == "disk") o.base_seconds += n_seq * pieces * static_cast<double>(L) * at.kv_disk;
    o.rec_seconds = {0, n_seq * pieces * at.rec_sel, n_seq * pieces * at.rec_none};
    o.io_seconds = 0;  // the K/V pages' and the optimizer state's traffic is measured into base_seconds
    o.disk_seconds_per_byte = n_seq * dsb;
    // The measured cost of a set on disk (at all) scaled by each policy's set.
    for (int p = 0; p < 2; ++p)
      o.disk_seconds[static_cast<size_t>(p)] =
          o.disk_allowed ? n_seq * at.act_disk * o.set_bytes[static_cast<size_t>(p)] / std::max(1.0, o.set_bytes[0]) : 0;
    in.options.push_back(o);
  }
  return in;
}

json::Value Plan::json(const TrainConfig& asked, const ModelConfig& cfg, size_t budget) const {
  json::Value o = json::Value::object();
  o.set("oomless_plan", json::Value::integer(1));
  o.set("model", json::Value::string(asked.model));
  json::Value shape = json::Value::object();
  for (const auto& [k, v] : std::vector<std::pair<const char*, int64_t>>{
           {"layers", cfg.L}, {"hidden", cfg.E}, {"intermediate", cfg.F}, {"heads", cfg.H}, {"kv_heads", cfg.Hkv},
           {"head_dim", cfg.D}, {"vocab", cfg.V}})
    shape.set(k, json::Value::integer(v));
  o.set("shape", std::move(shape));
  o.set("seq", json::Value::integer(asked.seq));
  o.set("budget", json::Value::integer(static_cast<int64_t>(budget)));
  json::Value s = json::Value::object();
  s.set("save-policy", json::Value::string(config.save_policy));
  s.set("act-offload", json::Value::string(config.act_offload));
  s.set("chunk", json::Value::integer(config.chunk));
  s.set("kv-offload", json::Value::string(config.kv_offload));
  s.set("optim-state", json::Value::string(config.optim_state));
  o.set("settings", std::move(s));
  json::Value p = json::Value::object();
  p.set("ram_peak", json::Value::integer(static_cast<int64_t>(estimate.ram_peak())));
  p.set("step_seconds", json::Value::number(pick.seconds));
  p.set("estimate", estimate.json());
  o.set("predicted", std::move(p));
  json::Value m = json::Value::object();
  m.set("cpu", json::Value::string(machine_cpu));
  m.set("threads", json::Value::integer(machine_threads));
  o.set("machine", std::move(m));
  if (!cost.is_null()) o.set("cost_model", cost);
  o.set("solver", json::Value::string(pick.solver));
  o.set("explain", json::Value::string(explain));
  return o;
}

Plan make_plan(const TrainConfig& c_in, size_t budget, const std::string& scratch, std::FILE* log) {
  TrainConfig c = c_in;
  validate_config(c);
  const ModelSource src = open_model(c.model, static_cast<uint64_t>(c.seed));
  const ModelConfig& cfg = src.cfg;
  // Chunk lengths worth measuring: halves of --seq down to 256 (at most three), each with a default page.
  std::vector<int64_t> chunks;
  for (int64_t C = c.seq / 2; C >= 256 && chunks.size() < 3; C /= 2)
    if (c.seq % C == 0 && default_page(C) > 0) chunks.push_back(C);
  Plan plan;
  const std::unique_ptr<Ops> ops = make_ops("cpu");
  const std::string shown = c_in.budget.empty() ? format_bytes(budget) : c_in.budget;  // as the user wrote it
  // The smallest run of an instance (every layer at none, the least memory of any choice) and its error.
  auto smallest_run = [&](const PlanInstance& in, size_t* best = nullptr) {
    double smallest = 0;
    for (size_t o = 0; o < in.options.size(); ++o) {
      const double b = in.bytes(o, std::vector<SavePolicy>(static_cast<size_t>(cfg.L), SavePolicy::none),
                                std::vector<bool>(static_cast<size_t>(cfg.L), false));
      if (o > 0 && b >= smallest) continue;
      smallest = b;
      if (best) *best = o;
    }
    return smallest;
  };
  auto nothing_fits = [&](const PlanInstance& in) {
    size_t best = 0;
    const double smallest = smallest_run(in, &best);
    const std::string flags = in.options[best].g.flags();
    fail("[plan] nothing fits --budget ", shown, ": the smallest run of ", c.model, " at --seq ", c.seq, " holds ",
         format_bytes(static_cast<size_t>(smallest)), " (--save-policy none", flags.empty() ? "" : " ", flags,
         "); give --budget ", format_bytes(static_cast<size_t>(std::ceil(smallest / kMiB + 1)) * size_t{1 << 20}),
         " or more, a shorter --seq, --lora r or --qlora");
  };
  // Before measuring anything: a budget nothing fits fails at once, naming the smallest that does; and a run
  // that fits keeping everything in memory is the fastest schedule there is (nothing recomputed or moved).
  {
    const PlanInstance mem = build_instance(c, src, budget, CostModel{}, chunks);
    if (smallest_run(mem) > static_cast<double>(budget)) nothing_fits(mem);
    TrainConfig keep = spill_for(with_global(c, PlanGlobal{}), "");
    keep.save_policy = "all";
    const MemoryEstimate e = estimate_training(spill_for(keep, "."), src, *ops);
    if (e.ram_peak() <= budget) {
      plan.config = keep;
      plan.estimate = e;
      plan.pick.feasible = true;
      plan.pick.policies.assign(static_cast<size_t>(cfg.L), SavePolicy::all);
      plan.pick.on_disk.assign(static_cast<size_t>(cfg.L), false);
      plan.pick.solver = "fits as given";
      plan.pick.bytes = static_cast<double>(e.ram_peak());
      plan.explain = "every layer keeps everything and nothing leaves memory: the fastest schedule, and it fits (" +
                     format_bytes(e.ram_peak()) + " of --budget " + format_bytes(budget) + "); nothing measured\n";
      return plan;
    }
  }
  fs::create_directories(scratch);
  const CostModel cost = measure_costs(c, src, chunks, scratch, log, budget);
  PlanInstance in = build_instance(c, src, budget, cost, chunks);
  plan.cost = cost.json();
  // The program's memory is the estimate's but for the ring of saved sets (two of the largest); the chosen
  // run is estimated exactly, and solved again under a budget lowered by any excess.
  double target = static_cast<double>(budget);
  for (int round = 0; round < 4; ++round) {
    in.budget = target;
    plan.pick = solve_plan(in);
    if (!plan.pick.feasible) break;
    plan.global = in.options[plan.pick.option].g;
    plan.config = with_global(c, plan.global);
    plan.config.save_policy = policy_spec(plan.pick.policies);
    plan.config.act_offload = tier_spec(plan.pick.on_disk);
    plan.global.act_offload = plan.config.act_offload;
    plan.config = spill_for(plan.config, "");
    plan.estimate = estimate_training(spill_for(plan.config, "."), src, *ops);
    if (plan.estimate.ram_peak() <= budget) break;
    target -= static_cast<double>(plan.estimate.ram_peak() - budget) + 1;
    plan.pick.feasible = round < 3;
  }
  if (!plan.pick.feasible) nothing_fits(in);
  // Why, in words.
  const PlanInstance::Option& o = in.options[plan.pick.option];
  char line[512];
  std::string why;
  std::snprintf(line, sizeof line,
                "measured on %s, %d threads: a layer's forward + backward %.1f ms, recompute at none %.1f ms, at "
                "selective %.1f ms, per sequence of %lld tokens; disk %.0f MB/s write, %.0f MB/s read\n",
                cost.cpu.c_str(), cost.threads, 1e3 * cost.at.at(plan.global.chunk ? plan.global.chunk : c.seq).block,
                1e3 * cost.at.at(plan.global.chunk ? plan.global.chunk : c.seq).rec_none,
                1e3 * cost.at.at(plan.global.chunk ? plan.global.chunk : c.seq).rec_sel,
                static_cast<long long>(plan.global.chunk ? plan.global.chunk : c.seq), cost.disk_write_bps / 1e6,
                cost.disk_read_bps / 1e6);
  why += line;
  int64_t n[3] = {0, 0, 0};
  for (SavePolicy p : plan.pick.policies) ++n[static_cast<int>(p)];
  std::snprintf(line, sizeof line,
                "%lld layers keep everything, %lld keep the matmul outputs (selective), %lld keep only their input: "
                "a layer at all holds %s, at selective %s; the layers that keep more are the ones the budget leaves "
                "room for (each recomputed layer costs its recompute time)\n",
                static_cast<long long>(n[0]), static_cast<long long>(n[1]), static_cast<long long>(n[2]),
                format_bytes(static_cast<size_t>(o.act_bytes[0])).c_str(),
                format_bytes(static_cast<size_t>(o.act_bytes[1])).c_str());
  why += line;
  const int64_t n_disk = std::count(plan.pick.on_disk.begin(), plan.pick.on_disk.end(), true);
  if (n_disk > 0)
    why += std::to_string(n_disk) + " of those layers send their saved sets to disk between forward and backward "
           "(--act-offload " + plan.config.act_offload + "): memory holds two of them at a time; the transfers "
           "overlap compute, and what they still add was measured (" +
           std::to_string(static_cast<int>(std::lround(1e3 * o.disk_seconds[0]))) + " ms a layer at all)\n";
  if (plan.global.chunk > 0)
    why += "chunk-recurrent training: activations of " + std::to_string(plan.global.chunk) +
           " tokens at a time (whole sequences do not fit, or are slower under this budget)\n";
  if (plan.global.kv_offload == "disk") why += "the K/V history lives on disk (it does not fit beside the rest)\n";
  if (plan.global.optim_state == "disk")
    why += "the optimizer state lives on disk, streamed through a window each step (it does not fit beside the rest)\n";
  std::snprintf(line, sizeof line, "predicted: %s (of --budget %s), %.3f s a step; %zu global choices x %lld layers, "
                "solved by GLPK (%s)\n", format_bytes(plan.estimate.ram_peak()).c_str(), format_bytes(budget).c_str(),
                plan.pick.seconds, in.options.size(), static_cast<long long>(cfg.L), plan.pick.solver.c_str());
  why += line;
  plan.explain = why;
  return plan;
}

std::string apply_plan(TrainConfig& c, const json::Value& plan, const std::string& source, const ModelConfig& cfg) {
  auto bad = [&](const std::string& what) {
    fail("[plan] ", source, ": ", what, "; make a plan for this run with `oomless plan ... --out FILE`");
  };
  if (!plan.is_object() || !plan.find("oomless_plan") || !plan.at("oomless_plan").is_number() ||
      plan.at("oomless_plan").as_number() != 1)
    bad("not a plan file (no \"oomless_plan\": 1)");
  const json::Value* shape = plan.find("shape");
  if (!shape || !shape->is_object()) bad("no \"shape\" object");
  for (const auto& [k, v] : std::vector<std::pair<const char*, int64_t>>{
           {"layers", cfg.L}, {"hidden", cfg.E}, {"intermediate", cfg.F}, {"heads", cfg.H}, {"kv_heads", cfg.Hkv},
           {"head_dim", cfg.D}, {"vocab", cfg.V}}) {
    const json::Value* x = shape->find(k);
    if (!x || !x->is_number() || x->as_number() != static_cast<double>(v))
      bad(std::string("it was made for another model (") + k + " " + (x && x->is_number() ? json::dump(*x) : "missing") +
          ", this model's " + std::to_string(v) + ")");
  }
  const json::Value* seq = plan.find("seq");
  if (!seq || !seq->is_number() || seq->as_number() != static_cast<double>(c.seq))
    bad("it was made for --seq " + (seq && seq->is_number() ? json::dump(*seq) : std::string("(missing)")) +
        ", this run has --seq " + std::to_string(c.seq));
  const json::Value* s = plan.find("settings");
  if (!s || !s->is_object()) bad("no \"settings\" object");
  auto text = [&](const char* k) {
    const json::Value* v = s->find(k);
    if (!v || !v->is_string()) bad(std::string("settings.") + k + " is missing or not a string");
    return v->as_string();
  };
  TrainConfig x = c;
  x.save_policy = text("save-policy");
  x.act_offload = text("act-offload");
  x.kv_offload = text("kv-offload");
  x.optim_state = text("optim-state");
  const json::Value* ch = s->find("chunk");
  if (!ch || !ch->is_number() || ch->as_number() < 0 || ch->as_number() != std::floor(ch->as_number()) ||
      ch->as_number() > static_cast<double>(c.seq))
    bad("settings.chunk must be a whole number from 0 to --seq");
  x.chunk = static_cast<int64_t>(ch->as_number());
  try {
    parse_save_policies(x.save_policy, cfg.L);
    validate_config(x);
  } catch (const Error& e) {
    bad(std::string("its settings are not a valid run: ") + e.what());
  }
  // --budget beside --plan: the plan's predicted peak must fit it (a plan for a larger budget would run out of
  // memory partway through the first step).
  if (!c.budget.empty()) {
    const json::Value* pr = plan.find("predicted");
    const json::Value* pk = pr && pr->is_object() ? pr->find("ram_peak") : nullptr;
    if (pk) {
      if (!pk->is_number() || !std::isfinite(pk->as_number()) || pk->as_number() < 0)
        bad("predicted.ram_peak must be a byte count");
      const size_t budget = parse_size(c.budget);
      const double peak = pk->as_number();
      if (peak > static_cast<double>(budget))
        bad("its run holds " + (peak < 1e18 ? format_bytes(static_cast<size_t>(peak)) : json::dump(*pk)) +
            ", more than this run's --budget " + c.budget + "; make a plan under --budget " + c.budget +
            ", or drop --budget to run this one");
    }
  }
  std::string warning;
  if (const json::Value* m = plan.find("machine")) {
    const json::Value* cpu = m->is_object() ? m->find("cpu") : nullptr;
    const json::Value* th = m->is_object() ? m->find("threads") : nullptr;
    if (!cpu || !cpu->is_string() || !th || !th->is_number())
      bad("\"machine\" must be an object with \"cpu\" (a string) and \"threads\" (a number)");
    const std::string& here = machine_cpu_name();
    const int threads = machine_threads();
    if (cpu->as_string() != here || th->as_number() != static_cast<double>(threads))
      warning = "[plan] " + source + " was made on " + cpu->as_string() + " with " + json::dump(*th) +
                " threads, and this run is on " + here + " with " + std::to_string(threads) +
                " threads: its memory plan holds, but its step times, and so its choices, were measured there; "
                "make a plan here (`oomless plan ... --out FILE`) for this machine's";
  }
  c = x;
  return warning;
}

int run_plan(const TrainConfig& c, const std::string& out, bool explain) {
  OOM_CHECK(!c.budget.empty(), "[plan] oomless plan needs --budget SIZE: the memory the run must fit in");
  const size_t budget = parse_size(c.budget);
  const fs::path dest = out.empty() ? fs::path("plan.json") : fs::path(out);
  const fs::path scratch = (dest.has_parent_path() ? dest.parent_path() : fs::path(".")) / ".oomless-plan";
  Plan p;
  try {
    p = make_plan(c, budget, scratch.string(), stderr);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(scratch, ec);
    throw;
  }
  std::error_code ec;
  fs::remove_all(scratch, ec);
  const ModelSource src = open_model(c.model, static_cast<uint64_t>(c.seed));
  const std::string text = json::dump(p.json(c, src.cfg, budget)) + "\n";
  {
    const fs::path tmp = dest.string() + ".tmp";
    std::ofstream f(tmp);
    f << text;
    f.close();
    OOM_CHECK(f, "[plan] cannot write ", tmp.string());
    fs::rename(tmp, dest);
  }
  const std::string flags = p.global.flags();
  std::printf("plan for %s at --seq %lld under --budget %s: --save-policy %s%s%s\n", c.model.c_str(),
              static_cast<long long>(c.seq), c.budget.c_str(), p.config.save_policy.c_str(), flags.empty() ? "" : " ",
              flags.c_str());
  char time[64] = "nothing to trade: every layer keeps everything";
  if (p.pick.seconds > 0) std::snprintf(time, sizeof time, "%.3f s a step", p.pick.seconds);
  std::printf("predicted: peak %s (%s), %s\nwritten to %s; run it with `oomless train ... --plan %s`\n",
              format_bytes(p.estimate.ram_peak()).c_str(), p.estimate.line().c_str(), time, dest.string().c_str(),
              dest.string().c_str());
  if (explain) std::printf("why:\n%s", p.explain.c_str());
  return 0;
}

}  // namespace oomless
