// LoRA adapters on a frozen base: finite-difference gradients of every adapter tensor in float64 (ref
// backend), equality with the merged weights W + s B A, an untrained adapter changing nothing, frozen
// means frozen (no base gradients or optimizer bytes, base bytes unchanged by training), bitwise equality
// across SavePolicies and K/V offload modes, and the settings' errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "optim/adamw.h"
#include "util/chunked_run.h"
#include "util/fd_check.h"
#include "util/golden_compare.h"

namespace oomless {
namespace {

using test::variants;

LoraSettings lora(int64_t r, const char* targets, double alpha, bool rslora = false, double dropout = 0,
                  bool dora = false) {
  LoraSettings s;
  s.r = r, s.alpha = alpha, s.rslora = rslora, s.dropout = dropout, s.dora = dora;
  s.targets = parse_lora_targets(targets);
  return s;
}

using test::perturb;

struct Seq {
  std::vector<int32_t> ids, tg;
  Tensor id_t() { return Tensor::of(ids.data(), {static_cast<int64_t>(ids.size())}); }
  Tensor tg_t() { return Tensor::of(tg.data(), {static_cast<int64_t>(tg.size())}); }
};
Seq seq(int64_t T, int64_t V, uint64_t seed) {
  Seq s;
  s.ids = test::tokens(T, V, seed);
  s.tg = test::targets_of(s.ids);
  return s;
}

// The adapted model (params + ad) and the merged one give the same loss and logits on s to float64
// rounding; returns the adapted model's loss.
double expect_same_as_merged(const ModelConfig& cfg, Ops& ops, ParamSet& params, AdapterSet& ad, ParamSet& merged,
                             Arena& arena, Seq& s) {
  const int64_t T = static_cast<int64_t>(s.ids.size()), V = cfg.V;
  Model a(cfg, ops, params, arena, {ComputeDType::f32, SavePolicy::all, &ad});
  Model b(cfg, ops, merged, arena);
  a.reserve(T, false);
  b.reserve(T, false);
  const double la = a.forward(s.id_t(), s.tg_t(), false).loss_sum, lb = b.forward(s.id_t(), s.tg_t(), false).loss_sum;
  EXPECT_NEAR(la, lb, 1e-11 * std::abs(lb));
  std::vector<double> ga(static_cast<size_t>(T * V)), gb(ga.size());
  a.logits(Tensor::of(ga.data(), {T, V}));
  b.logits(Tensor::of(gb.data(), {T, V}));
  for (size_t i = 0; i < ga.size(); ++i) EXPECT_NEAR(ga[i], gb[i], 1e-11) << i;
  return la;
}

TEST(Lora, AdapterGradientsMatchFiniteDifferences) {
  // The dropout cases: the mask is fixed by the seed, so the loss is a smooth function of the adapter.
  // DoRA: the magnitudes' gradients too, the norm held constant (as PEFT detaches it) in the loss as well;
  // DoRA with dropout in PEFT's form (DoraWithDropoutIsPeftsForm).
  const LoraSettings settings[] = {lora(3, "all-linear", 6.0), lora(2, "q,v,down", 3.0, true),
                                   lora(2, "all-linear", 4.0, false, 0.3), lora(3, "all-linear", 6.0, false, 0, true),
                                   lora(2, "k,o,up", 3.0, true, 0, true), lora(2, "all-linear", 4.0, false, 0.3, true)};
  for (const test::Variant& var : variants()) {
    for (const LoraSettings& ls : settings) {
      SCOPED_TRACE(std::string(var.name) + " r=" + std::to_string(ls.r));
      Ledger ledger;
      Arena arena(Tier::Host, size_t{1} << 30, ledger);
      auto ops = make_ops("ref");
      ParamSet params(var.cfg, DType::f64, arena, Category::weights);
      init_random(*ops, params, 7, 0.3);
      perturb(params, 8);
      auto ad = test::random_adapters(var.cfg, ls, DType::f64, arena, 21);
      Model m(var.cfg, *ops, params, arena, {ComputeDType::f32, SavePolicy::all, ad.get()});
      m.set_dropout_seed(5);
      const int64_t T = 9;
      m.reserve(T, true);
      Seq s = seq(T, var.cfg.V, 3);
      CeResult r = m.forward(s.id_t(), s.tg_t(), true);
      const double scale = 1.0 / static_cast<double>(r.count);
      m.backward(scale);
      // A training forward (dropout on, the same seed) for every evaluation; DoRA's norm held constant.
      m.hold_dora_norms(true);
      auto loss = [&]() { return m.forward(s.id_t(), s.tg_t(), true).loss_sum * scale; };
      EXPECT_GT(test::check_sampled_gradients(ad->tensors(), m.adapter_grads().tensors(), loss, 3, 11), 20);
    }
  }
}

// y = x W^T + s (x A^T) B^T is the base model with W + s B A (by hand here), and DoRA merged by merge_lora
// (W_j <- m_j (W + s B A)_j / ||(W + s B A)_j||) is the base model with those weights, in float64 to rounding.
TEST(Lora, EqualsTheBaseWithMergedWeights) {
  for (const bool dora : {false, true})
  for (const test::Variant& var : variants()) {
    SCOPED_TRACE(std::string(var.name) + (dora ? " dora" : ""));
    Ledger ledger;
    Arena arena(Tier::Host, size_t{1} << 30, ledger);
    auto ops = make_ops("ref");
    const LoraSettings ls = lora(3, "all-linear", 5.0, false, 0, dora);
    ParamSet params(var.cfg, DType::f64, arena, Category::weights);
    init_random(*ops, params, 7, 0.3);
    perturb(params, 8);
    auto ad = test::random_adapters(var.cfg, ls, DType::f64, arena, 21);
    ParamSet merged(var.cfg, DType::f64, arena, Category::weights);
    std::memcpy(merged.data(), params.data(), params.bytes());
    const double sc = ls.scale();
    for (int64_t l = 0; l < var.cfg.L && !dora; ++l)
      for (Proj p : ls.targets) {
        const Tensor* w = merged.find("model.layers." + std::to_string(l) + "." + proj_module(p) + ".weight");
        ASSERT_NE(w, nullptr);
        const LoraTensors& t = ad->layer(l)[p];
        const int64_t N = w->dims[0], K = w->dims[1];
        for (int64_t n = 0; n < N; ++n)
          for (int64_t k = 0; k < K; ++k) {
            double d = 0;
            for (int64_t j = 0; j < ls.r; ++j)
              d += static_cast<double*>(t.b.data)[n * ls.r + j] * static_cast<double*>(t.a.data)[j * K + k];
            static_cast<double*>(w->data)[n * K + k] += sc * d;
          }
      }
    if (dora) merge_lora(*ops, merged, *ad, arena);
    const int64_t T = 11;
    Seq s = seq(T, var.cfg.V, 4);
    const double la = expect_same_as_merged(var.cfg, *ops, params, *ad, merged, arena, s);
    EXPECT_GT(std::abs(la - [&] {
                Model c(var.cfg, *ops, params, arena);
                c.reserve(T, false);
                return c.forward(s.id_t(), s.tg_t(), false).loss_sum;
              }()),
              1e-6)
        << "the adapter must change the loss for this test to mean anything";
  }
}

// B = 0 (PEFT's init): the adapted model computes exactly the base model, fp32 and bf16; with DoRA too
// (m = ||W||, so g = 1), on a model with biases.
TEST(Lora, AnUntrainedAdapterChangesNothing) {
  for (int k = 0; k < 4; ++k) {
    const ComputeDType dt = k % 2 ? ComputeDType::bf16 : ComputeDType::f32;
    const bool dora = k >= 2;
    const test::Variant var = variants()[dora ? 2 : 0];
    CpuMemory mem(size_t{1} << 32);
    auto ops = make_ops("cpu", &mem.device);
    ParamSet params(var.cfg, DType::f32, mem.device, Category::weights);
    init_random(*ops, params, 5, 0.3);
    AdapterSet ad(var.cfg, lora(4, "all-linear", 8.0, false, 0, dora), DType::f32, mem.device, Category::adapter);
    init_lora(*ops, ad, 1);
    init_dora(*ops, ad, params);
    const int64_t T = 21;
    Seq s = seq(T, var.cfg.V, 6);
    Model a(var.cfg, *ops, params, mem.device, {dt, SavePolicy::all, &ad});
    Model b(var.cfg, *ops, params, mem.device, {dt, SavePolicy::all});
    a.reserve(T, false);
    b.reserve(T, false);
    const double la = a.forward(s.id_t(), s.tg_t(), false).loss_sum, lb = b.forward(s.id_t(), s.tg_t(), false).loss_sum;
    EXPECT_EQ(std::memcmp(&la, &lb, sizeof la), 0) << (dt == ComputeDType::bf16 ? "bf16" : "fp32") << (dora ? " dora" : "");
  }
}

TEST(Lora, FrozenBaseHasNoGradientsAndTrainingLeavesItsBytes) {
  for (bool dora : {false, true}) {
  SCOPED_TRACE(dora ? "dora" : "lora");
  const test::Variant var = variants()[2];  // biases: their gradients must not exist either
  CpuMemory mem(size_t{1} << 32);
  auto ops = make_ops("cpu", &mem.device);
  ParamSet params(var.cfg, DType::f32, mem.device, Category::weights);
  init_random(*ops, params, 5, 0.3);
  perturb(params, 6);
  const Tensor all(params.data(), DType::u8, {static_cast<int64_t>(params.bytes())}, Tier::Device);
  const std::vector<uint8_t> before = test::tensor_values<uint8_t>(all);
  AdapterSet ad(var.cfg, lora(4, "all-linear", 8.0, false, 0, dora), DType::f32, mem.device, Category::adapter);
  init_lora(*ops, ad, 1);
  init_dora(*ops, ad, params);
  Model m(var.cfg, *ops, params, mem.device, {ComputeDType::f32, SavePolicy::all, &ad});
  const TrainableSet tr = m.trainable();
  AdamW opt(tr, mem.device, {1e-2, 0.9, 0.95, 1e-8, 0.1});  // stepped by the device's Ops: its state is there
  EXPECT_THROW(m.grads(), Error);
  // Gradients and optimizer state are the adapter's size, not the model's.
  EXPECT_EQ(mem.ledger.current(Tier::Device, Category::grads), ad.tensors().bytes());
  EXPECT_EQ(mem.ledger.current(Tier::Device, Category::optimizer), 2 * ad.tensors().bytes());
  const int64_t T = 17;
  m.reserve(T, true);
  Seq s = seq(T, var.cfg.V, 6);
  double first = 0, last = 0;
  for (int64_t step = 1; step <= 8; ++step) {
    m.zero_grads();
    const CeResult r = m.forward(s.id_t(), s.tg_t(), true);
    m.backward(1.0 / static_cast<double>(r.count));
    opt.step(*ops, tr, 1e-2, step);
    (step == 1 ? first : last) = r.loss_sum / static_cast<double>(r.count);
  }
  EXPECT_LT(last, first) << "the adapter trains";
  EXPECT_EQ(test::tensor_values<uint8_t>(all), before) << "the base changed";
  EXPECT_EQ(mem.ledger.current(Tier::Device, Category::grads), ad.tensors().bytes());
  }
}

// A training forward told the backward's grad_scale takes a frozen head's dh with the loss (one pass over
// the vocabulary): the loss bit for bit, the adapter gradients within fp32 rounding of the two-pass form
// (and not bitwise, so the one-pass path ran); a trainable head keeps the two-pass form, bit for bit; a
// backward with another scale is an error.
TEST(Lora, OnePassHeadGivesTheTwoPassGradients) {
  for (const bool adapters : {true, false}) {
    SCOPED_TRACE(adapters ? "adapters" : "full");
    const test::Variant var = variants()[0];
    CpuMemory mem(size_t{1} << 32);
    auto ops = make_ops("cpu", &mem.device);
    ParamSet params(var.cfg, DType::f32, mem.device, Category::weights);
    init_random(*ops, params, 5, 0.3);
    auto ad = adapters ? test::random_adapters(var.cfg, lora(4, "all-linear", 8.0), DType::f32, mem.device, 3) : nullptr;
    Model m(var.cfg, *ops, params, mem.device, {ComputeDType::f32, SavePolicy::all, ad.get()});
    const TrainableSet tr = m.trainable();
    const int64_t T = 33;
    m.reserve(T, true);
    Seq s = seq(T, var.cfg.V, 4);
    auto grads = [&](bool one_pass, double* loss) {
      m.zero_grads();
      const double scale = 1.0 / 29;
      *loss = m.forward(s.id_t(), s.tg_t(), true, one_pass ? std::optional<double>(scale) : std::nullopt).loss_sum;
      m.backward(scale);
      std::vector<std::vector<float>> g;
      for (const Trainable& t : tr) g.push_back(test::tensor_values<float>(t.grad));
      return g;
    };
    double l2 = 0, l1 = 0;
    const auto two = grads(false, &l2), one = grads(true, &l1);
    EXPECT_EQ(std::memcmp(&l1, &l2, sizeof l1), 0);
    bool all_same = true;
    for (size_t i = 0; i < one.size(); ++i) {
      double num = 0, den = 0;
      for (size_t k = 0; k < one[i].size(); ++k) {
        num += (one[i][k] - two[i][k]) * (one[i][k] - two[i][k]);
        den += static_cast<double>(two[i][k]) * two[i][k];
      }
      EXPECT_LE(std::sqrt(num / std::max(den, 1e-300)), 1e-5) << tr[i].name;
      all_same = all_same && std::memcmp(one[i].data(), two[i].data(), one[i].size() * sizeof(float)) == 0;
    }
    EXPECT_EQ(all_same, !adapters);
    m.forward(s.id_t(), s.tg_t(), true, 0.5);
    if (adapters) {
      EXPECT_THROW(m.backward(0.25), Error);
    }
  }
}

// Adapter gradients are bitwise the same for every SavePolicy (fp32 and bf16) and every K/V offload mode,
// LoRA and DoRA.
TEST(Lora, BitwiseAcrossSavePoliciesAndOffloadModes) {
  const std::vector<int32_t> ids = test::tokens(64, 37, 9);
  for (const test::Variant& var : variants()) {
    for (int k = 0; k < 4; ++k) {
      const ComputeDType dt = k % 2 ? ComputeDType::bf16 : ComputeDType::f32;
      const bool dora = k >= 2;
      SCOPED_TRACE(std::string(var.name) + (dt == ComputeDType::bf16 ? " bf16" : " fp32") + (dora ? " dora" : ""));
      test::RunSetup s{var.cfg};
      s.dtype = dt, s.lora_r = 3, s.dora = dora;
      const test::Result all = test::run(s, ids, 0, 0, KvOffload::none);
      ASSERT_FALSE(all.names.empty());
      EXPECT_NE(all.names[0].find("lora_A"), std::string::npos);
      for (SavePolicy p : {SavePolicy::selective, SavePolicy::none}) {
        s.policy = p;
        EXPECT_TRUE(test::same_bits(all, test::run(s, ids, 0, 0, KvOffload::none))) << save_policy_name(p);
      }
      s.policy = SavePolicy::none;
      const test::Result dev = test::run(s, ids, 16, 8, KvOffload::none);
      // Chunks change the attention's summation order: within fp32 rounding of the full sequence.
      if (dt == ComputeDType::f32) {
        for (size_t i = 0; i < all.grads.size(); ++i) EXPECT_LT(test::rel_l2(dev.grads[i], all.grads[i]), 1e-5) << i;
      }
      for (KvOffload k : {KvOffload::host, KvOffload::disk})
        EXPECT_TRUE(test::same_bits(dev, test::run(s, ids, 16, 8, k))) << kv_offload_name(k);
    }
  }
}

// Dropout: on in training passes only, drawn from the seed (same seed, same bits; another seed, another
// loss), and the same masks under every SavePolicy, offload mode and chunking.
TEST(Lora, DropoutIsSeededAndOnlyInTraining) {
  const test::Variant var = variants()[3];
  Ledger ledger;
  Arena arena(Tier::Host, size_t{1} << 30, ledger);
  auto ops = make_ops("cpu");
  ParamSet params(var.cfg, DType::f32, arena, Category::weights);
  init_random(*ops, params, 7, 0.3);
  auto with = test::random_adapters(var.cfg, lora(3, "all-linear", 6.0, false, 0.4), DType::f32, arena, 21);
  auto without = test::random_adapters(var.cfg, lora(3, "all-linear", 6.0), DType::f32, arena, 21);
  Model a(var.cfg, *ops, params, arena, {ComputeDType::f32, SavePolicy::all, with.get()});
  Model b(var.cfg, *ops, params, arena, {ComputeDType::f32, SavePolicy::all, without.get()});
  const int64_t T = 24;
  Seq s = seq(T, var.cfg.V, 8);
  a.reserve(T, true);
  b.reserve(T, true);
  auto loss = [&](Model& m, bool train, uint64_t seed) {
    m.set_dropout_seed(seed);
    return m.forward(s.id_t(), s.tg_t(), train).loss_sum;
  };
  const double eval_a = loss(a, false, 1), eval_b = loss(b, false, 1);
  EXPECT_EQ(std::memcmp(&eval_a, &eval_b, sizeof eval_a), 0) << "evaluation must not drop anything";
  const double t1 = loss(a, true, 1), t1again = loss(a, true, 1), t2 = loss(a, true, 2), tb = loss(b, true, 1);
  EXPECT_EQ(std::memcmp(&t1, &t1again, sizeof t1), 0);
  EXPECT_NE(t1, t2);
  EXPECT_NE(t1, tb);
  // Bitwise across SavePolicies and offload modes; chunked within fp32 rounding of the full sequence; LoRA
  // and DoRA (PEFT's form with dropout).
  const std::vector<int32_t> ids = test::tokens(64, 37, 9);
  for (const bool dora : {false, true}) {
    SCOPED_TRACE(dora ? "dora" : "lora");
    test::RunSetup rs{var.cfg};
    rs.lora_r = 3, rs.lora_dropout = 0.25, rs.dora = dora;
    const test::Result all = test::run(rs, ids, 0, 0, KvOffload::none);
    rs.lora_dropout = 0;
    EXPECT_FALSE(test::same_bits(all, test::run(rs, ids, 0, 0, KvOffload::none)));
    rs.lora_dropout = 0.25;
    for (SavePolicy p : {SavePolicy::selective, SavePolicy::none}) {
      rs.policy = p;
      EXPECT_TRUE(test::same_bits(all, test::run(rs, ids, 0, 0, KvOffload::none))) << save_policy_name(p);
    }
    const test::Result chunked = test::run(rs, ids, 16, 8, KvOffload::none);
    for (size_t i = 0; i < all.grads.size(); ++i) EXPECT_LT(test::rel_l2(chunked.grads[i], all.grads[i]), 1e-5) << i;
    EXPECT_TRUE(test::same_bits(chunked, test::run(rs, ids, 16, 8, KvOffload::disk)));
  }
}

// DoRA with dropout, y = x W^T + b + (g - 1) x_d W^T + g s B A x_d (x_d = dropout(x)): with every magnitude set
// to its row's norm ||W + s B A|| (g = 1) a training pass is LoRA with the same dropout masks, to float64 rounding,
// and evaluation has no dropout. PEFT's own numbers with g != 1: LoraPeft.DoraWithDropoutMatchesPeft; the
// gradients against finite differences: AdapterGradientsMatchFiniteDifferences.
TEST(Lora, DoraWithDropoutIsPeftsForm) {
  for (const test::Variant& var : variants()) {
    SCOPED_TRACE(var.name);
    Ledger ledger;
    Arena arena(Tier::Host, size_t{1} << 30, ledger);
    auto ops = make_ops("ref");
    ParamSet params(var.cfg, DType::f64, arena, Category::weights);
    init_random(*ops, params, 7, 0.3);
    const LoraSettings dora_s = lora(3, "all-linear", 6.0, false, 0.3, true), lora_s = lora(3, "all-linear", 6.0, false, 0.3);
    auto dora = test::random_adapters(var.cfg, dora_s, DType::f64, arena, 21);
    auto plain = test::random_adapters(var.cfg, lora_s, DType::f64, arena, 21);
    const double sc = 6.0 / 3;
    for (int64_t l = 0; l < var.cfg.L; ++l)
      for (Proj p : dora_s.targets) {
        const LoraTensors& t = dora->layer(l)[p];
        const Tensor w = proj_weight(params.layers[static_cast<size_t>(l)], p);
        const int64_t N = w.dims[0], K = w.dims[1], r = 3;
        const double* W = static_cast<const double*>(w.data);
        const double* A = static_cast<const double*>(t.a.data);
        const double* B = static_cast<const double*>(t.b.data);
        std::memcpy(plain->layer(l)[p].a.data, A, static_cast<size_t>(r * K) * 8);  // the same adapter
        std::memcpy(plain->layer(l)[p].b.data, B, static_cast<size_t>(N * r) * 8);
        for (int64_t j = 0; j < N; ++j) {
          double nn = 0;
          for (int64_t k = 0; k < K; ++k) {
            double v = W[j * K + k];
            for (int64_t q = 0; q < r; ++q) v += sc * B[j * r + q] * A[q * K + k];
            nn += v * v;
          }
          static_cast<double*>(t.m.data)[j] = std::sqrt(nn);
        }
      }
    Model d(var.cfg, *ops, params, arena, {ComputeDType::f32, SavePolicy::all, dora.get()});
    Model l(var.cfg, *ops, params, arena, {ComputeDType::f32, SavePolicy::all, plain.get()});
    const int64_t T = 12;
    d.reserve(T, true);
    l.reserve(T, true);
    Seq s = seq(T, var.cfg.V, 4);
    d.set_dropout_seed(9);
    l.set_dropout_seed(9);
    const double ld = d.forward(s.id_t(), s.tg_t(), true).loss_sum, ll = l.forward(s.id_t(), s.tg_t(), true).loss_sum;
    EXPECT_NEAR(ld, ll, 1e-12 * std::abs(ll)) << "training";
    const double ed = d.forward(s.id_t(), s.tg_t(), false).loss_sum, el = l.forward(s.id_t(), s.tg_t(), false).loss_sum;
    EXPECT_NEAR(ed, el, 1e-12 * std::abs(el)) << "evaluation";
    EXPECT_GT(std::abs(ld - ed), 1e-6) << "the training pass had dropout";
  }
}

TEST(Lora, BadSettingsAreClearErrors) {
  const ModelConfig cfg = test::small_config();
  auto message = [&](LoraSettings s) {
    try {
      validate_lora(s, cfg);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message(lora(0, "q", 1.0)).find("positive rank"), std::string::npos);
  EXPECT_EQ(message(lora(13, "q", 1.0)), "");  // q_proj is 24 x 16
  EXPECT_NE(message(lora(17, "q", 1.0)).find("self_attn.q_proj (24 x 16): r may be at most 16"), std::string::npos);
  EXPECT_NE(message(lora(13, "k", 1.0)).find("self_attn.k_proj (12 x 16): r may be at most 12"), std::string::npos);
  EXPECT_EQ(message(lora(12, "k,v", 1.0)), "");
  EXPECT_NE(message(lora(2, "q", -1.0)).find("--lora-alpha"), std::string::npos);
  try {
    parse_lora_targets("q,attn");
    FAIL() << "unknown target accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown projection 'attn'"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("gate, up, down"), std::string::npos);
  }
  EXPECT_EQ(parse_lora_targets("v_proj,q").size(), 2u);
  EXPECT_EQ(parse_lora_targets("all-linear").size(), 7u);
}

}  // namespace
}  // namespace oomless
