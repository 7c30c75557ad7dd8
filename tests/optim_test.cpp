// Optimizer pieces: AdamW against torch.optim.AdamW (tools/golden/make_optim.py: a tiny tied model with
// biases and q/k norms, decay and no-decay groups, 5 steps at a different lr each), the global
// gradient norm and clipping (torch.nn.utils.clip_grad_norm_ semantics), and the lr schedules.
//
// AdamW tolerances, per tensor, relative L2: oomless fp32 (cpu) <= 1e-6 against torch fp32 and against
// torch float64; oomless float64 (ref backend) <= 1e-12 against torch float64 (the same math).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "io/json.h"
#include "io/safetensors.h"
#include "memory/arena.h"
#include "model/params.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "optim/schedule.h"
#include "util/harness.h"

namespace oomless {
namespace {

constexpr size_t kBudget = size_t{1} << 30;

// The model make_optim.py lays out: L=1, E=8, F=12, H=2, Hkv=1, D=4, V=16, tied, all biases, q/k norms.
ModelConfig golden_config() {
  ModelConfig c;
  c.L = 1, c.E = 8, c.F = 12, c.H = 2, c.Hkv = 1, c.D = 4, c.V = 16;
  c.tied = c.qkv_bias = c.o_bias = c.qk_norm = true;
  return c;
}

// dst = golden tensor `name` (F32 in the file: exact in f32 and f64 parameter sets).
void load(Tensor dst, const SafetensorsFile& f, const std::string& name) {
  const std::vector<double> v = test::golden_f64(f, name);
  ASSERT_EQ(static_cast<int64_t>(v.size()), dst.numel()) << name;
  convert(dst.data, dst.dtype, v.data(), DType::f64, dst.numel());
}

struct GoldenRun {
  ModelConfig cfg = golden_config();
  Ledger ledger;
  Arena arena{Tier::Host, kBudget, ledger};
  SafetensorsFile golden = SafetensorsFile::open(test::source_path("tests/golden/optim/adamw.safetensors"));
};

// Runs the golden's 5 steps on `backend` with parameter sets of `dtype` and compares the parameters
// and both moments with the golden tensors under `prefix` ("fp32." or "f64.").
void run_golden(const std::string& backend, DType dtype, const std::vector<std::pair<std::string, double>>& refs) {
  GoldenRun g;
  const json::Value info = json::parse(g.golden.metadata().at("golden"), "adamw.safetensors metadata");
  const std::vector<double> lrs = test::golden_f64(g.golden, "lr"), hp = test::golden_f64(g.golden, "hparams");
  ASSERT_EQ(lrs.size(), 5u);
  ASSERT_EQ(hp.size(), 4u);

  ParamSet params(g.cfg, dtype, g.arena, Category::weights);
  ParamSet grads(g.cfg, dtype, g.arena, Category::grads);
  // The golden's tensors and decay groups are exactly our layout (the tied lm_head appears once).
  ASSERT_EQ(info.at("decay").size(), params.specs().size());
  for (const ParamSpec& s : params.specs()) {
    ASSERT_NE(info.at("decay").find(s.name), nullptr) << s.name;
    EXPECT_EQ(info.at("decay").at(s.name).as_bool(), s.decay) << s.name;
  }
  for (size_t i = 0; i < params.specs().size(); ++i) load(params.tensors()[i], g.golden, "init." + params.specs()[i].name);

  AdamWSettings st;
  st.lr = lrs[0], st.beta1 = hp[0], st.beta2 = hp[1], st.eps = hp[2], st.weight_decay = hp[3];
  AdamW opt(trainable_set(params, grads), g.arena, st);
  EXPECT_EQ(g.ledger.current(Tier::Host, Category::optimizer), 2 * params.bytes());
  EXPECT_EQ(opt.m().dtype(), dtype);

  auto ops = make_ops(backend);
  const size_t peak_before = g.ledger.peak_all();
  for (int64_t k = 1; k <= 5; ++k) {
    for (size_t i = 0; i < params.specs().size(); ++i)
      load(grads.tensors()[i], g.golden, "grad" + std::to_string(k) + "." + params.specs()[i].name);
    opt.step(*ops, trainable_set(params, grads), lrs[static_cast<size_t>(k - 1)], k);
  }
  EXPECT_EQ(g.ledger.peak_all(), peak_before) << "step() must not allocate";

  for (const auto& [prefix, tol] : refs) {
    for (size_t i = 0; i < params.specs().size(); ++i) {
      const std::string& n = params.specs()[i].name;
      EXPECT_LE(test::rel_l2(test::tensor_f64(params.tensors()[i]), test::golden_f64(g.golden, prefix + n)), tol) << backend << " " << prefix << n;
      EXPECT_LE(test::rel_l2(test::tensor_f64(opt.m().tensors()[i]), test::golden_f64(g.golden, prefix + "m." + n)), tol)
          << backend << " " << prefix << "m." << n;
      EXPECT_LE(test::rel_l2(test::tensor_f64(opt.v().tensors()[i]), test::golden_f64(g.golden, prefix + "v." + n)), tol)
          << backend << " " << prefix << "v." << n;
    }
  }
}

TEST(AdamW, MatchesTorchFp32OnCpu) { run_golden("cpu", DType::f32, {{"fp32.", 1e-6}, {"f64.", 1e-6}}); }

TEST(AdamW, MatchesTorchFloat64OnRef) { run_golden("ref", DType::f64, {{"f64.", 1e-12}}); }

TEST(AdamW, RefusesMismatchedSets) {
  GoldenRun g;
  ParamSet params(g.cfg, DType::f32, g.arena, Category::weights);
  ParamSet grads(g.cfg, DType::f32, g.arena, Category::grads);
  AdamWSettings st;
  AdamW opt(trainable_set(params, grads), g.arena, st);
  auto ops = make_ops("cpu");
  ModelConfig other = g.cfg;
  other.tied = false;
  ParamSet untied(other, DType::f32, g.arena, Category::weights);
  ParamSet ugrads(other, DType::f32, g.arena, Category::grads);
  ParamSet params64(g.cfg, DType::f64, g.arena, Category::weights);
  ParamSet grads64(g.cfg, DType::f64, g.arena, Category::grads);
  EXPECT_THROW(opt.step(*ops, trainable_set(untied, ugrads), 1e-3, 1), Error);
  EXPECT_THROW(opt.step(*ops, trainable_set(params64, grads64), 1e-3, 1), Error);
  EXPECT_THROW(opt.step(*ops, trainable_set(params, grads), 1e-3, 0), Error);
  EXPECT_NO_THROW(opt.step(*ops, trainable_set(params, grads), 1e-3, 1));
  EXPECT_THROW(AdamW(TrainableSet{}, g.arena, st), Error);  // nothing to train
  st.beta2 = 1.0;
  EXPECT_THROW(AdamW(trainable_set(params, grads), g.arena, st), Error);
}

// ---- gradient norm and clipping ----

// A gradient set as the clip functions see it (the parameters are not read).
TrainableSet grads_only(const ParamSet& g) { return trainable_set(g, g); }

struct Grads {
  ModelConfig cfg = golden_config();
  Ledger ledger;
  Arena arena{Tier::Host, kBudget, ledger};
  ParamSet g{cfg, DType::f32, arena, Category::grads};
  // Element j of tensor i is ((i * 7 + j) % 11 - 5) / 4: exact in f32, so the norm is known exactly.
  Grads() {
    for (size_t i = 0; i < g.tensors().size(); ++i) {
      float* p = g.tensors()[i].as<float>("test");
      for (int64_t j = 0; j < g.tensors()[i].numel(); ++j)
        p[j] = static_cast<float>((static_cast<int64_t>(i) * 7 + j) % 11 - 5) / 4.0f;
    }
  }
  double expected_norm() const {
    double s = 0;
    for (const Tensor& t : g.tensors())
      for (double x : test::tensor_f64(t)) s += x * x;
    return std::sqrt(s);
  }
};

TEST(Clip, GlobalNormIsTheNormOfAllGradients) {
  for (const std::string b : {"ref", "cpu"}) {
    Grads gr;
    auto ops = make_ops(b);
    // The golden layout is f32; ref computes in f64, so give it an f64 copy.
    ParamSet g64(gr.cfg, DType::f64, gr.arena, Category::grads);
    convert_params(*ops, g64, gr.g);
    const double n = global_grad_norm(*ops, grads_only(b == "ref" ? g64 : gr.g));
    EXPECT_NEAR(n, gr.expected_norm(), 1e-12 * gr.expected_norm()) << b;
    EXPECT_GT(n, 1.0) << b;
  }
}

TEST(Clip, ScalesByMaxOverNormPlusEpsilonWhenAbove) {
  Grads gr;
  auto ops = make_ops("cpu");
  // A small norm, so that torch's + 1e-6 changes the scale by ~1e-3 and is checked too.
  for (const Tensor& t : gr.g.tensors()) ops->scale(t, 1e-4);
  const std::vector<std::vector<double>> before = [&] {
    std::vector<std::vector<double>> v;
    for (const Tensor& t : gr.g.tensors()) v.push_back(test::tensor_f64(t));
    return v;
  }();
  const double norm = global_grad_norm(*ops, grads_only(gr.g));
  const double max_norm = norm / 3;
  clip_grads(*ops, grads_only(gr.g), max_norm, norm);
  const double s = max_norm / (norm + 1e-6);
  for (size_t i = 0; i < before.size(); ++i) {
    const std::vector<double> after = test::tensor_f64(gr.g.tensors()[i]);
    for (size_t j = 0; j < after.size(); ++j)
      ASSERT_NEAR(after[j], before[i][j] * s, 1e-7 * std::abs(before[i][j])) << i << " " << j;
  }
  // torch's clip lands just under max_norm.
  const double clipped = global_grad_norm(*ops, grads_only(gr.g));
  EXPECT_LT(clipped, max_norm);
  EXPECT_NEAR(clipped, max_norm * norm / (norm + 1e-6), 1e-6 * max_norm);
}

TEST(Clip, LeavesGradientsAloneAtOrBelowMaxNorm) {
  Grads gr;
  auto ops = make_ops("cpu");
  std::vector<char> before(static_cast<const char*>(gr.g.data()),
                           static_cast<const char*>(gr.g.data()) + gr.g.bytes());
  const double norm = global_grad_norm(*ops, grads_only(gr.g));
  clip_grads(*ops, grads_only(gr.g), norm, norm);
  clip_grads(*ops, grads_only(gr.g), 2 * norm, norm);
  EXPECT_EQ(std::memcmp(before.data(), gr.g.data(), before.size()), 0);
}

TEST(Clip, NonfiniteNormIsReportedAndNotApplied) {
  Grads gr;
  auto ops = make_ops("cpu");
  gr.g.layers[0].wk.as<float>("test")[3] = std::numeric_limits<float>::infinity();
  const double inf_norm = global_grad_norm(*ops, grads_only(gr.g));
  EXPECT_TRUE(std::isinf(inf_norm));
  gr.g.layers[0].wk.as<float>("test")[3] = std::numeric_limits<float>::quiet_NaN();
  const double nan_norm = global_grad_norm(*ops, grads_only(gr.g));
  EXPECT_TRUE(std::isnan(nan_norm));
  const float first = gr.g.embed.as<float>("test")[1];
  EXPECT_THROW(clip_grads(*ops, grads_only(gr.g), 1.0, nan_norm), Error);
  EXPECT_THROW(clip_grads(*ops, grads_only(gr.g), 1.0, inf_norm), Error);
  EXPECT_EQ(gr.g.embed.as<float>("test")[1], first);
  EXPECT_THROW(clip_grads(*ops, grads_only(gr.g), 0.0, 1.0), Error);
}

// ---- schedules ----

ScheduleSettings sched(const char* kind, double lr, double min_lr, int64_t warmup, int64_t total) {
  ScheduleSettings s;
  s.kind = kind, s.lr = lr, s.min_lr = min_lr, s.warmup = warmup, s.total_steps = total;
  return s;
}

TEST(Schedule, CosineWithWarmupAndFloor) {
  const ScheduleSettings s = sched("cosine", 1e-3, 1e-4, 10, 110);
  EXPECT_DOUBLE_EQ(lr_at(s, 1), 1e-4);
  EXPECT_DOUBLE_EQ(lr_at(s, 5), 5e-4);
  EXPECT_DOUBLE_EQ(lr_at(s, 10), 1e-3);
  // progress 0.25: 1e-4 + 9e-4 * 0.5 * (1 + cos(pi/4))
  EXPECT_NEAR(lr_at(s, 35), 8.681980515339464e-4, 1e-18);
  EXPECT_NEAR(lr_at(s, 60), 5.5e-4, 1e-18);  // progress 0.5: halfway between peak and floor
  EXPECT_NEAR(lr_at(s, 110), 1e-4, 1e-18);
  EXPECT_NEAR(lr_at(s, 500), 1e-4, 1e-18);
  // No warmup: step 1 already decays (progress 1/100).
  EXPECT_NEAR(lr_at(sched("cosine", 1.0, 0.0, 0, 100), 1), 0.5 * (1 + std::cos(M_PI / 100)), 1e-15);
}

TEST(Schedule, LinearAndConstant) {
  const ScheduleSettings lin = sched("linear", 1.0, 0.0, 4, 14);
  EXPECT_DOUBLE_EQ(lr_at(lin, 2), 0.5);
  EXPECT_DOUBLE_EQ(lr_at(lin, 4), 1.0);
  EXPECT_DOUBLE_EQ(lr_at(lin, 9), 0.5);
  EXPECT_DOUBLE_EQ(lr_at(lin, 14), 0.0);
  EXPECT_DOUBLE_EQ(lr_at(sched("linear", 1.0, 0.2, 0, 10), 5), 0.6);
  const ScheduleSettings c = sched("constant", 2.0, 0.0, 3, 10);
  EXPECT_DOUBLE_EQ(lr_at(c, 1), 2.0 / 3);
  EXPECT_DOUBLE_EQ(lr_at(c, 3), 2.0);
  EXPECT_DOUBLE_EQ(lr_at(c, 10), 2.0);
  EXPECT_DOUBLE_EQ(lr_at(c, 1000), 2.0);
}

TEST(Schedule, RisesThroughWarmupThenFallsToTheFloor) {
  for (const char* kind : {"cosine", "linear"}) {
    const ScheduleSettings s = sched(kind, 3e-4, 3e-5, 25, 300);
    double prev = 0;
    for (int64_t t = 1; t <= 320; ++t) {
      const double lr = lr_at(s, t);
      if (t <= 25) {
        EXPECT_GT(lr, prev) << kind << " step " << t;
      } else {
        EXPECT_LE(lr, prev) << kind << " step " << t;
        if (t <= 300) {
          EXPECT_LT(lr, prev) << kind << " step " << t;
        }
        // The floor holds once warmup is over (warmup starts from lr / warmup, as transformers does).
        EXPECT_GE(lr, s.min_lr) << kind << " step " << t;
      }
      EXPECT_LE(lr, s.lr) << kind << " step " << t;
      prev = lr;
    }
    EXPECT_NEAR(lr_at(s, 300), s.min_lr, 1e-18) << kind;
  }
}

TEST(Schedule, RejectsBadSettingsNamingWhatIsSupported) {
  try {
    lr_at(sched("cosine_with_restarts", 1e-3, 0, 0, 10), 1);
    FAIL() << "unknown kind accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cosine, linear, constant"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("cosine_with_restarts"), std::string::npos) << e.what();
  }
  EXPECT_THROW(lr_at(sched("cosine", 1e-3, 0, 0, 10), 0), Error);
  EXPECT_THROW(lr_at(sched("cosine", 1e-3, 1e-2, 0, 10), 1), Error);   // floor above peak
  EXPECT_THROW(lr_at(sched("cosine", 1e-3, 0, 11, 10), 1), Error);     // warmup past the end
  EXPECT_THROW(lr_at(sched("linear", 1e-3, 0, 0, 0), 1), Error);
  EXPECT_NO_THROW(validate(sched("constant", 1e-3, 0, 10, 10)));
}

}  // namespace
}  // namespace oomless
