// The planner (plan/planner.h): GLPK's optimum is the cost model's true optimum (every choice enumerated on
// small instances), a plan fits its budget by the ledger and trains, plan files are checked against the run,
// and a budget nothing fits names the smallest one that does.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "plan/cost.h"
#include "plan/milp.h"
#include "plan/planner.h"
#include "train/trainer.h"

namespace oomless {
namespace {

TEST(Milp, SolvesASmallKnapsack) {
  // max 5a + 4b + 3c s.t. 2a + 3b + c <= 5, binaries: a + c (8) beats a + b (9)? 2+3 = 5 fits: a + b = 9, a + c = 8,
  // b + c = 7, all three 10 needs 6. Optimum 9 (as a minimisation of the negation).
  Milp m;
  const int a = m.binary("a"), b = m.binary("b"), c = m.binary("c");
  m.row({{a, 2}, {b, 3}, {c, 1}}, -Milp::kInf, 5);
  m.minimize({{a, -5}, {b, -4}, {c, -3}});
  const Milp::Solution s = m.solve();
  ASSERT_TRUE(s.feasible) << s.status;
  EXPECT_DOUBLE_EQ(s.objective, -9);
  EXPECT_EQ(s.x[static_cast<size_t>(a)], 1);
  EXPECT_EQ(s.x[static_cast<size_t>(b)], 1);
  EXPECT_EQ(s.x[static_cast<size_t>(c)], 0);
  Milp none;
  const int x = none.binary("x");
  none.row({{x, 1}}, 2, Milp::kInf);
  EXPECT_FALSE(none.solve().feasible);
}

TEST(Milp, IntegerColumnsTakeWholeValues) {
  // max 3a + 2b s.t. 2a + b <= 7.5, a in 0..4, b in 0..5: the relaxation's a = 1.25 (13.75) is not whole; a = 1,
  // b = 5 (13) is the optimum.
  Milp m;
  const int a = m.integer("a", 0, 4), b = m.integer("b", 0, 5);
  m.row({{a, 2}, {b, 1}}, -Milp::kInf, 7.5);
  m.minimize({{a, -3}, {b, -2}});
  const Milp::Solution s = m.solve();
  ASSERT_TRUE(s.feasible) << s.status;
  EXPECT_DOUBLE_EQ(s.objective, -13);
  EXPECT_EQ(s.x[static_cast<size_t>(a)], 1);
  EXPECT_EQ(s.x[static_cast<size_t>(b)], 5);
}

PlanInstance random_instance(std::mt19937_64& rng, int64_t L) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  PlanInstance in;
  in.L = L;
  const int G = 1 + static_cast<int>(rng() % 4);
  for (int g = 0; g < G; ++g) {
    PlanInstance::Option o;
    o.g.chunk = g;
    o.base_bytes = (100 + 400 * u(rng)) * 1048576.0;
    o.disk_allowed = rng() % 3 == 0;
    const double a = (5 + 50 * u(rng)) * 1048576.0;
    o.act_bytes = {a, a * (0.3 + 0.6 * u(rng)), 0};
    o.set_bytes = {o.act_bytes[0] * 1.01, o.act_bytes[1] * 1.01, 0};
    o.base_seconds = 1 + 5 * u(rng);
    const double r = 0.05 + 0.3 * u(rng);
    o.rec_seconds = {0, r * (0.02 + 0.3 * u(rng)), r};
    o.io_seconds = rng() % 2 ? 0 : 3 * u(rng);
    o.disk_seconds_per_byte = o.disk_allowed ? (0.5 + 3 * u(rng)) / 1e9 : 0;
    const double d = o.disk_allowed ? 0.1 * u(rng) : 0;  // what a set on disk adds to compute
    o.disk_seconds = {d, d * o.set_bytes[1] / o.set_bytes[0], 0};
    in.options.push_back(o);
  }
  in.budget = (150 + 600 * u(rng)) * 1048576.0;
  return in;
}

TEST(Planner, GlpkFindsTheTrueOptimumOfTheCostModelOnSmallInstances) {
  std::mt19937_64 rng(7);
  int feasible = 0;
  for (int k = 0; k < 200; ++k) {
    const PlanInstance in = random_instance(rng, 1 + static_cast<int64_t>(rng() % 6));
    SCOPED_TRACE(k);
    const PlanPick milp = solve_plan(in), all = enumerate_plan(in);
    ASSERT_EQ(milp.feasible, all.feasible);
    if (!all.feasible) continue;
    ++feasible;
    EXPECT_LE(milp.bytes, in.budget);
    EXPECT_NEAR(milp.seconds, all.seconds, 1e-6 * all.seconds) << "GLPK " << milp.seconds << ", every choice " << all.seconds;
  }
  EXPECT_GE(feasible, 60) << "too few feasible instances to show anything";
}

// Layers are alike, so at a real model's depth every choice is a count of layers per state (all, selective,
// none in memory; all, selective on disk): GLPK's optimum is the best of them all at 30 layers too, quickly
// (a program with a binary per layer and state once ran for half an hour on such an instance).
TEST(Planner, GlpkFindsTheTrueOptimumAtThirtyLayers) {
  std::mt19937_64 rng(11);
  int feasible = 0;
  for (int k = 0; k < 12; ++k) {
    const int64_t L = 30;
    PlanInstance in = random_instance(rng, L);
    in.budget *= 4;  // thirty layers' activations beside the base
    SCOPED_TRACE(k);
    const PlanPick milp = solve_plan(in);
    PlanPick best;
    std::vector<SavePolicy> p(static_cast<size_t>(L));
    std::vector<bool> d(static_cast<size_t>(L));
    for (size_t o = 0; o < in.options.size(); ++o)
      for (int64_t a = 0; a <= L; ++a)                  // all on disk
        for (int64_t b = 0; a + b <= L; ++b)            // selective on disk
          for (int64_t c = 0; a + b + c <= L; ++c)      // all in memory
            for (int64_t e = 0; a + b + c + e <= L; ++e) {  // selective in memory; the rest none
              if ((a + b > 0) && !in.options[o].disk_allowed) continue;
              for (int64_t l = 0; l < L; ++l) {
                const int64_t n0 = a, n1 = a + b, n2 = n1 + c, n3 = n2 + e;
                p[static_cast<size_t>(l)] = l < n0 || (l >= n1 && l < n2) ? SavePolicy::all
                                            : l < n1 || (l >= n2 && l < n3) ? SavePolicy::selective
                                                                            : SavePolicy::none;
                d[static_cast<size_t>(l)] = l < n1;
              }
              const double bytes = in.bytes(o, p, d);
              if (bytes > in.budget) continue;
              const double sec = in.seconds(o, p, d);
              if (!best.feasible || sec < best.seconds) best = {true, o, p, d, sec, bytes, "counts"};
            }
    ASSERT_EQ(milp.feasible, best.feasible);
    if (!best.feasible) continue;
    ++feasible;
    EXPECT_LE(milp.bytes, in.budget);
    EXPECT_NEAR(milp.seconds, best.seconds, 1e-6 * best.seconds) << "GLPK " << milp.seconds << ", every count " << best.seconds;
  }
  EXPECT_GE(feasible, 4) << "too few feasible instances to show anything";
}

TrainConfig micro(int64_t seq) {
  TrainConfig c;
  c.model = "preset:micro";
  c.seq = seq;
  c.batch = 1;
  c.steps = 2;
  c.lr = 1e-3;
  c.warmup = 1;
  c.eval_every = 0;
  return c;
}

std::string scratch() {
  const std::string d = std::filesystem::current_path().string() + "/planner_test_scratch";  // not tmpfs
  std::filesystem::create_directories(d);
  return d;
}

// A budget between keeping nothing and keeping everything: the plan recomputes some layers, fits by the ledger
// and trains; its file brings the same settings back onto the run.
TEST(Planner, APlanFitsItsBudgetByTheLedgerAndItsFileAppliesToTheRun) {
  const TrainConfig c = micro(256);
  const ModelSource src = open_model(c.model);
  TrainConfig none = c, all = c;
  none.save_policy = "none";
  const size_t lo = estimate_training(none).ram_peak(), hi = estimate_training(all).ram_peak();
  ASSERT_LT(lo, hi);
  const size_t budget = lo + (hi - lo) / 2;
  const Plan p = make_plan(c, budget, scratch());
  ASSERT_TRUE(p.pick.feasible);
  EXPECT_LE(p.estimate.ram_peak(), budget);
  EXPECT_NE(p.config.save_policy, "all") << "everything kept cannot fit this budget";
  Trainer t(p.config, "");
  const StepBatch b = synthetic_batch(1, 256, src.cfg.V);
  t.step(b);
  const Ledger& l = t.engine().mem->ledger;
  EXPECT_LE(l.peak_total(Tier::Device) + l.peak_total(Tier::Host), budget);

  const json::Value file = p.json(c, src.cfg, budget);
  TrainConfig back = c;
  apply_plan(back, file, "plan.json", src.cfg);
  EXPECT_EQ(back.save_policy, p.config.save_policy);
  EXPECT_EQ(back.chunk, p.config.chunk);
  EXPECT_EQ(back.optim_state, p.config.optim_state);
}

TEST(Planner, ABudgetNothingFitsNamesTheSmallestThatDoes) {
  try {
    make_plan(micro(256), size_t{1} << 20, scratch());
    FAIL() << "a plan under 1 MiB";
  } catch (const Error& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("nothing fits --budget 1.00 MiB"), std::string::npos) << w;
    EXPECT_NE(w.find("or more"), std::string::npos) << w;
  }
}

TEST(Planner, APlanFileForAnotherRunIsRefusedByName) {
  const TrainConfig c = micro(128);
  const ModelSource micro_src = open_model("preset:micro"), tiny = open_model("preset:tiny");
  json::Value p = json::parse(R"({"oomless_plan": 1, "shape": {"layers": 2, "hidden": 64}, "seq": 128})");
  auto refused = [&](const json::Value& plan, const ModelConfig& cfg, const char* what) {
    TrainConfig x = c;
    try {
      apply_plan(x, plan, "p.json", cfg);
      ADD_FAILURE() << "accepted: " << json::dump(plan);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("p.json"), std::string::npos) << e.what();
    }
  };
  Plan made;
  made.config = c;
  json::Value good = made.json(c, micro_src.cfg, 1 << 30);
  {
    TrainConfig x = c;
    apply_plan(x, good, "p.json", micro_src.cfg);
  }
  refused(good, tiny.cfg, "another model");
  TrainConfig longer = c;
  longer.seq = 256;
  try {
    apply_plan(longer, good, "p.json", micro_src.cfg);
    ADD_FAILURE() << "a plan for --seq 128 accepted at 256";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--seq 128"), std::string::npos) << e.what();
  }
  refused(json::parse("[1]"), micro_src.cfg, "not a plan file");
  json::Value bad = good;
  json::Value s = good.at("settings");
  s.set("save-policy", json::Value::string("all:0-9"));
  bad.set("settings", s);
  refused(bad, micro_src.cfg, "not a valid run");
  (void)p;
}

// The cut models the cost model runs need no more memory than the budget allows: four layers, or fewer.
TEST(Planner, TheLargerCutModelFitsTheBudget) {
  TrainConfig c = micro(64);
  c.model = "preset:tiny";  // six layers
  const ModelSource src = open_model(c.model);
  auto cut_peak = [&](int64_t L) {
    json::Value j = src.cfg.to_json();
    j.set("num_hidden_layers", json::Value::integer(L));
    const std::string dir = scratch() + "/cut-" + std::to_string(L);
    std::filesystem::create_directories(dir);
    std::ofstream(dir + "/config.json") << json::dump(j);
    TrainConfig t = c;
    t.model = dir + "/config.json";
    t.steps = 1 << 20;
    t.eval_every = 0;
    return estimate_training(t).ram_peak();
  };
  const size_t p3 = cut_peak(3), p4 = cut_peak(4);
  ASSERT_LT(p3, p4);
  EXPECT_EQ(cut_layers(c, src.cfg, scratch(), 0), 4);
  EXPECT_EQ(cut_layers(c, src.cfg, scratch(), p4), 4);
  EXPECT_EQ(cut_layers(c, src.cfg, scratch(), p4 - 1), 3);
  EXPECT_EQ(cut_layers(c, src.cfg, scratch(), p3 - 1), 2) << "never fewer than two";
  for (const char* cut : {"/plan-cut-1-narrow", "/plan-cut-3-narrow"}) std::filesystem::remove_all(scratch() + cut);
  EXPECT_EQ(measure_costs(c, src, {}, scratch(), nullptr, p4 - 1).cut_layers, 3) << "the cut measured";
  // The layers were timed on cuts with a narrow vocabulary (tiny's is 8192), which open as models.
  for (const char* cut : {"/plan-cut-1-narrow/config.json", "/plan-cut-3-narrow/config.json"}) {
    ASSERT_TRUE(std::filesystem::exists(scratch() + cut)) << cut;
    const ModelSource n = open_model(scratch() + cut);
    EXPECT_EQ(n.cfg.V, 1024) << cut;
    EXPECT_EQ(n.cfg.E, src.cfg.E) << cut;
  }
}

TEST(Planner, APlanFileFromAnotherMachineWarnsAndOneOverTheBudgetIsRefused) {
  const TrainConfig c = micro(128);
  const ModelSource src = open_model("preset:micro");
  Plan made;
  made.config = c;
  const json::Value here = made.json(c, src.cfg, 1 << 30);
  {
    TrainConfig x = c;
    EXPECT_EQ(apply_plan(x, here, "p.json", src.cfg), "") << "made on this machine";
  }
  json::Value there = here;
  json::Value m = json::Value::object();
  m.set("cpu", json::Value::string("Another CPU (avx2 fma)"));
  m.set("threads", json::Value::integer(machine_threads()));
  there.set("machine", m);
  {
    TrainConfig x = c;
    x.save_policy = "none";
    const std::string w = apply_plan(x, there, "p.json", src.cfg);
    EXPECT_NE(w.find("p.json was made on Another CPU (avx2 fma)"), std::string::npos) << w;
    EXPECT_NE(w.find("make a plan here"), std::string::npos) << w;
    EXPECT_EQ(x.save_policy, "all") << "the settings still apply";
  }
  m = here.at("machine");
  m.set("threads", json::Value::integer(machine_threads() + 1));
  there.set("machine", m);
  {
    TrainConfig x = c;
    EXPECT_NE(apply_plan(x, there, "p.json", src.cfg).find("threads"), std::string::npos) << "another thread count";
  }
  auto refused = [&](const json::Value& plan, const std::string& budget, const char* what) {
    TrainConfig x = c;
    x.budget = budget;
    try {
      apply_plan(x, plan, "p.json", src.cfg);
      ADD_FAILURE() << "accepted under --budget '" << budget << "': " << json::dump(plan);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("p.json"), std::string::npos) << e.what();
    }
  };
  there.set("machine", json::Value::string("mine"));
  refused(there, "", "\"machine\" must be an object");
  json::Value big = here;
  json::Value pr = json::Value::object();
  pr.set("ram_peak", json::Value::integer(int64_t{3} << 20));
  big.set("predicted", pr);
  refused(big, "2MiB", "its run holds 3.00 MiB, more than this run's --budget 2MiB");
  for (const char* fits : {"3MiB", ""}) {
    TrainConfig x = c;
    x.budget = fits;
    EXPECT_EQ(apply_plan(x, big, "p.json", src.cfg), "") << "--budget '" << fits << "'";
  }
  pr.set("ram_peak", json::Value::number(-1.0));
  big.set("predicted", pr);
  refused(big, "2MiB", "predicted.ram_peak must be a byte count");
  pr.set("ram_peak", json::Value::number(1e300));
  big.set("predicted", pr);
  refused(big, "2MiB", "more than this run's --budget");
}

}  // namespace
}  // namespace oomless
