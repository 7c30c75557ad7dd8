// The decoder against itself: finite-difference gradients of the whole model in float64 (ref backend),
// bitwise equality across SavePolicies, and the KV-cache decode path against the full forward.
// (Agreement with transformers is model_golden_test.cpp.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "memory/arena.h"
#include "util/fd_check.h"
#include "util/golden_compare.h"
#include "model/model.h"

namespace oomless {
namespace {

struct Variant {
  const char* name;
  ModelConfig cfg;
};

ModelConfig small_config() {
  ModelConfig c;
  c.L = 2, c.E = 16, c.F = 24, c.H = 4, c.Hkv = 2, c.D = 6, c.V = 37;
  c.rms_eps = 1e-5;
  c.rope.theta = 500.0;
  return c;
}

std::vector<Variant> variants() {
  std::vector<Variant> v;
  ModelConfig c = small_config();
  v.push_back({"llama_gqa_untied", c});
  c.tied = true, c.Hkv = 4;
  v.push_back({"llama_mha_tied", c});
  c = small_config();
  c.qkv_bias = c.o_bias = true;
  c.rope.scaling = RopeScaling::llama3, c.rope.factor = 4.0, c.rope.original_max_position = 4.0;
  v.push_back({"llama_bias_llama3", c});
  c = small_config();
  c.arch = Arch::qwen3, c.qk_norm = true, c.D = 8;
  v.push_back({"qwen3_headdim", c});
  return v;
}

using test::perturb;

struct Inputs {
  std::vector<int32_t> ids, targets;
};

Inputs make_inputs(int64_t T, int64_t V, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Inputs in;
  for (int64_t t = 0; t < T; ++t) in.ids.push_back(static_cast<int32_t>(rng() % static_cast<uint64_t>(V)));
  for (int64_t t = 0; t < T; ++t) in.targets.push_back(t + 1 < T ? in.ids[static_cast<size_t>(t + 1)] : -100);
  in.targets[2] = -100;  // an unsupervised row in the middle
  return in;
}

class ModelFd : public ::testing::TestWithParam<int> {};

TEST_P(ModelFd, EveryParameterGradientMatchesFiniteDifferences) {
  const Variant var = variants()[static_cast<size_t>(GetParam())];
  SCOPED_TRACE(var.name);
  Ledger ledger;
  Arena arena(Tier::Host, size_t{1} << 30, ledger);
  auto ops = make_ops("ref");
  ParamSet params(var.cfg, DType::f64, arena, Category::weights);
  init_random(*ops, params, 7, 0.3);
  perturb(params, 8);
  Model m(var.cfg, *ops, params, arena);
  const int64_t T = 9;
  m.reserve(T, true);
  Inputs in = make_inputs(T, var.cfg.V, 3);
  Tensor ids = Tensor::of(in.ids.data(), {T}), tg = Tensor::of(in.targets.data(), {T});
  CeResult r = m.forward(ids, tg, true);
  const double scale = 1.0 / static_cast<double>(r.count);
  m.backward(scale);
  auto loss = [&]() {
    CeResult q = m.forward(ids, tg, false);
    return q.loss_sum * scale;
  };
  EXPECT_GT(test::check_sampled_gradients(params, m.grads(), loss, 4, 11), 40);
}

INSTANTIATE_TEST_SUITE_P(Variants, ModelFd, ::testing::Range(0, 4));

// Loss bits and gradient bytes of one forward/backward, for a policy and compute dtype.
struct RunResult {
  double loss;
  std::vector<char> grads;
};

RunResult run_once(const ModelConfig& cfg, SavePolicy pol, ComputeDType dt, std::vector<SavePolicy> layers = {},
                   size_t* activations = nullptr) {
  Ledger ledger;
  Arena arena(Tier::Host, size_t{1} << 30, ledger);
  auto ops = make_ops("cpu");
  ParamSet params(cfg, DType::f32, arena, Category::weights);
  init_random(*ops, params, 5, 0.2);
  perturb(params, 6);
  ModelOptions mo{dt, pol};
  mo.save_layers = std::move(layers);
  Model m(cfg, *ops, params, arena, mo);
  const int64_t T = 33;
  m.reserve(T, true);
  if (activations) *activations = ledger.peak(Tier::Host, Category::activations);
  Inputs in = make_inputs(T, cfg.V, 4);
  CeResult r = m.forward(Tensor::of(in.ids.data(), {T}), Tensor::of(in.targets.data(), {T}), true);
  m.backward(1.0 / static_cast<double>(r.count));
  RunResult out{r.loss_sum, {}};
  out.grads.resize(m.grads().bytes());
  std::memcpy(out.grads.data(), m.grads().data(), out.grads.size());
  return out;
}

TEST(Model, SavePoliciesGiveBitwiseTheSameLossAndGradients) {
  for (const Variant& var : variants()) {
    for (ComputeDType dt : {ComputeDType::f32, ComputeDType::bf16}) {
      SCOPED_TRACE(std::string(var.name) + (dt == ComputeDType::bf16 ? " bf16" : " fp32"));
      RunResult all = run_once(var.cfg, SavePolicy::all, dt);
      for (SavePolicy p : {SavePolicy::selective, SavePolicy::none}) {
        RunResult o = run_once(var.cfg, p, dt);
        EXPECT_EQ(std::memcmp(&all.loss, &o.loss, sizeof(double)), 0) << save_policy_name(p);
        ASSERT_EQ(all.grads.size(), o.grads.size());
        EXPECT_EQ(std::memcmp(all.grads.data(), o.grads.data(), all.grads.size()), 0) << save_policy_name(p);
      }
    }
  }
}

// A SavePolicy per layer (--save-policy all:0,none:1 ...): the same bits as one policy for all, and each
// layer's activations as its policy keeps them (a layer kept whole and one recomputed hold half of what two
// kept whole hold, above two recomputed).
TEST(Model, PerLayerSavePoliciesGiveTheSameBitsAndKeepTheirLayersBytes) {
  using P = SavePolicy;
  for (const Variant& var : variants()) {
    ASSERT_EQ(var.cfg.L, 2);
    for (ComputeDType dt : {ComputeDType::f32, ComputeDType::bf16}) {
      SCOPED_TRACE(std::string(var.name) + (dt == ComputeDType::bf16 ? " bf16" : " fp32"));
      size_t all_bytes = 0, none_bytes = 0, mixed_bytes = 0;
      const RunResult all = run_once(var.cfg, P::all, dt, {}, &all_bytes);
      run_once(var.cfg, P::none, dt, {}, &none_bytes);
      for (const std::vector<P>& layers : {std::vector<P>{P::all, P::none}, std::vector<P>{P::none, P::selective},
                                           std::vector<P>{P::selective, P::all}}) {
        size_t bytes = 0;
        const RunResult o = run_once(var.cfg, P::none, dt, layers, &bytes);
        const std::string what = std::string(save_policy_name(layers[0])) + "," + save_policy_name(layers[1]);
        EXPECT_EQ(std::memcmp(&all.loss, &o.loss, sizeof(double)), 0) << what;
        ASSERT_EQ(all.grads.size(), o.grads.size());
        EXPECT_EQ(std::memcmp(all.grads.data(), o.grads.data(), all.grads.size()), 0) << what;
        if (layers[0] == P::all) mixed_bytes = bytes;
      }
      EXPECT_GT(all_bytes, none_bytes);
      EXPECT_EQ(2 * (mixed_bytes - none_bytes), all_bytes - none_bytes);
    }
  }
}

TEST(Model, SavePolicyListsParseAndBadOnesAreNamed) {
  using P = SavePolicy;
  EXPECT_EQ(parse_save_policies("selective", 3), (std::vector<P>{P::selective, P::selective, P::selective}));
  EXPECT_EQ(parse_save_policies("all:0-1,none:2-3", 4), (std::vector<P>{P::all, P::all, P::none, P::none}));
  EXPECT_EQ(parse_save_policies("none,all:1", 3), (std::vector<P>{P::none, P::all, P::none}));
  EXPECT_EQ(parse_save_policies("all:2,selective", 3), (std::vector<P>{P::selective, P::selective, P::all}));
  EXPECT_EQ(parse_save_policies("all:0-3,none:4-31", -1), (std::vector<P>{P::all, P::none}));
  const std::pair<const char*, const char*> bad[] = {
      {"", "is empty"},
      {"most", "'most' is not a save policy"},
      {"all:0-1,", "an empty item"},
      {"all,,none:1", "an empty item"},
      {"all:0-4", "layer 4 is past the model's last layer, 3"},
      {"all:0-2,none:2-3", "layer 2 is named twice"},
      {"all:0-1", "layer 2 has no save policy"},
      {"all,none", "two items without layers"},
      {"all:3-1", "the range 3-1 is empty"},
      {"all:x", "'x' is not a layer"},
      {"all:-2", "'-2' is not a layer"}};
  for (const auto& [spec, message] : bad) {
    try {
      parse_save_policies(spec, 4);
      ADD_FAILURE() << "'" << spec << "' was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << spec << ": " << e.what();
    }
  }
}

TEST(Model, CachedDecodeMatchesTheFullForward) {
  for (const Variant& var : variants()) {
    SCOPED_TRACE(var.name);
    Ledger ledger;
    Arena arena(Tier::Host, size_t{1} << 30, ledger);
    auto ops = make_ops("ref");
    ParamSet params(var.cfg, DType::f64, arena, Category::weights);
    init_random(*ops, params, 9, 0.3);
    perturb(params, 10);
    Model m(var.cfg, *ops, params, arena);
    const int64_t T = 12, V = var.cfg.V;
    Inputs in = make_inputs(T, V, 5);
    m.reserve(T, false);
    m.forward(Tensor::of(in.ids.data(), {T}), Tensor::of(in.targets.data(), {T}), false);
    std::vector<double> full(static_cast<size_t>(T * V));
    m.logits(Tensor::of(full.data(), {T, V}));

    // Prefill 5 tokens, then one at a time.
    const int64_t Hkv = var.cfg.Hkv, D = var.cfg.D, cap = 16;
    std::vector<std::vector<double>> store(static_cast<size_t>(2 * var.cfg.L), std::vector<double>(Hkv * cap * D));
    std::vector<KvSlots> cache;
    for (int64_t l = 0; l < var.cfg.L; ++l)
      cache.push_back({Tensor::of(store[2 * l].data(), {Hkv, cap, D}), Tensor::of(store[2 * l + 1].data(), {Hkv, cap, D}), 0});
    std::vector<double> last(static_cast<size_t>(V));
    m.decode_forward(Tensor::of(in.ids.data(), {5}), 0, cache, Tensor::of(last.data(), {V}));
    for (int64_t j = 0; j < V; ++j) ASSERT_NEAR(last[j], full[4 * V + j], 1e-10);
    for (int64_t t = 5; t < T; ++t) {
      m.decode_forward(Tensor::of(in.ids.data() + t, {1}), t, cache, Tensor::of(last.data(), {V}));
      for (int64_t j = 0; j < V; ++j) ASSERT_NEAR(last[j], full[t * V + j], 1e-10) << "t=" << t;
    }
  }
}

}  // namespace
}  // namespace oomless
