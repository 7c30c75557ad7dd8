// AdamW8bit against bitsandbytes (tools/golden/make_optim8bit.py: bnb.optim.AdamW8bit's CPU update over
// 20 steps of three tensors, its weight decay applied after each step as its CUDA kernel does), against
// the float64 model of the same algorithm (the ref backend), and its edge cases: non-finite gradient
// elements, the fp32 path of small tensors, the state's bytes, names and checkpoint round trip.
//
// Tolerances (relative L2 per tensor): bitsandbytes' CPU path and ours compute the same float32 operations
// in nearly the same order (torch may fuse a multiply-add), so after 20 steps every state code is the same
// and parameters and scales agree to 1e-7 (measured: at most 3.8e-8; step 1 of the no-decay tensor is
// bitwise). The float64 model (ref backend, the same codes from the same grid) is held to 1e-6 against both
// (measured 1.8e-7): a code flipped by float32 rounding would move one moment by a whole code step.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <tuple>

#include "backend/cpu/adam8.h"
#include "backend/ops.h"
#include "core/dynamic8.h"
#include "io/json.h"
#include "io/safetensors.h"
#include "memory/arena.h"
#include "model/params.h"
#include "optim/adamw8bit.h"
#include "util/harness.h"

namespace oomless {
namespace {

constexpr size_t kBudget = size_t{1} << 30;

std::vector<uint8_t> read_u8(const SafetensorsFile& f, const std::string& name) {
  const StTensor* t = f.find(name);
  OOM_CHECK(t && t->dtype == DType::u8, "golden tensor ", name, " missing or not U8");
  const uint8_t* p = static_cast<const uint8_t*>(t->data);
  return std::vector<uint8_t>(p, p + t->numel());
}

struct Golden {
  SafetensorsFile f = SafetensorsFile::open(test::source_path("tests/golden/optim/adamw8bit.safetensors"));
  std::vector<double> lr = test::golden_f64(f, "lr"), hp = test::golden_f64(f, "hparams");
  std::vector<ParamSpec> specs() const {
    return {{"small", {3, 300}, true}, {"odd", {17, 257}, true}, {"even", {5120}, false}};
  }
  AdamWSettings settings() const { return {lr[0], hp[0], hp[1], hp[2], hp[3]}; }
};

// One run of the golden's steps on `backend` with parameter sets of `dtype`.
struct Stepper {
  Golden g;
  Ledger ledger;
  Arena arena{Tier::Host, kBudget, ledger};
  std::unique_ptr<Ops> ops;
  ParamSet params, grads;
  TrainableSet set;
  std::unique_ptr<AdamW8bit> opt;

  Stepper(const std::string& backend, DType dtype)
      : ops(make_ops(backend)),
        params(g.specs(), dtype, arena, Category::weights, "params"),
        grads(g.specs(), dtype, arena, Category::grads, "grads") {
    for (size_t i = 0; i < params.specs().size(); ++i) {
      set.push_back({params.specs()[i].name, params.tensors()[i], grads.tensors()[i], params.specs()[i].decay});
      const std::vector<double> v = test::golden_f64(g.f, "init." + set[i].name);
      convert(set[i].param.data, dtype, v.data(), DType::f64, set[i].param.numel());
    }
    opt = std::make_unique<AdamW8bit>(set, arena, g.settings());
  }
  void step(int k) {  // 1-based
    for (Trainable& t : set) {
      const std::vector<double> v = test::golden_f64(g.f, "grad" + std::to_string(k) + "." + t.name);
      convert(t.grad.data, t.grad.dtype, v.data(), DType::f64, t.grad.numel());
    }
    opt->step(*ops, set, g.lr[static_cast<size_t>(k - 1)], k);
  }
  std::vector<double> state_f64(const std::string& name) {
    for (const NamedTensor& t : opt->state())
      if (t.name == name) return test::tensor_f64(t.t);
    ADD_FAILURE() << "no state " << name;
    return {};
  }
  std::vector<uint8_t> codes(const std::string& name) {
    for (const NamedTensor& t : opt->state())
      if (t.name == name) {
        const uint8_t* p = static_cast<const uint8_t*>(t.t.data);
        return std::vector<uint8_t>(p, p + t.t.numel());
      }
    ADD_FAILURE() << "no state " << name;
    return {};
  }
};

TEST(Dynamic8, MapsAreBitsandbytes) {
  Golden g;
  for (auto [name, table] : {std::pair{"signed_map", dyn8::kSigned}, std::pair{"unsigned_map", dyn8::kUnsigned}}) {
    const StTensor* t = g.f.find(name);
    ASSERT_TRUE(t && t->nbytes == 256 * sizeof(float)) << name;
    EXPECT_EQ(std::memcmp(t->data, table, 256 * sizeof(float)), 0) << name;
  }
}

TEST(AdamW8bit, MatchesBitsandbytesOnCpu) {
  Stepper r("cpu", DType::f32);
  EXPECT_FALSE(r.opt->quantized(0));
  EXPECT_TRUE(r.opt->quantized(1) && r.opt->quantized(2));
  for (int k = 1; k <= 20; ++k) {
    r.step(k);
    if (k == 1 || k == 20)
      for (const Trainable& t : r.set) {
        const double e = test::rel_l2(test::tensor_f64(t.param), test::golden_f64(r.g.f, "after" + std::to_string(k) + "." + t.name));
        EXPECT_LE(e, 1e-7) << "step " << k << " " << t.name;
      }
  }
  // fp32 state of the small tensor: bitsandbytes' 32-bit update.
  EXPECT_LE(test::rel_l2(r.state_f64("m.small"), test::golden_f64(r.g.f, "state1.small")), 1e-7);
  EXPECT_LE(test::rel_l2(r.state_f64("v.small"), test::golden_f64(r.g.f, "state2.small")), 1e-7);
  for (const char* n : {"odd", "even"}) {
    for (auto [ours, theirs, scale, theirs_scale] :
         {std::tuple{"m.", "state1.", "m_absmax.", "absmax1."}, std::tuple{"v.", "state2.", "v_absmax.", "absmax2."}}) {
      const std::vector<uint8_t> a = r.codes(ours + std::string(n)), b = read_u8(r.g.f, theirs + std::string(n));
      ASSERT_EQ(a.size(), b.size());
      size_t differ = 0;
      for (size_t i = 0; i < a.size(); ++i) differ += a[i] != b[i];
      EXPECT_EQ(differ, 0u) << ours << n << ": " << differ << " of " << a.size() << " codes differ";
      EXPECT_LE(test::rel_l2(r.state_f64(scale + std::string(n)), test::golden_f64(r.g.f, theirs_scale + std::string(n))), 1e-7)
          << scale << n;
    }
  }
}

TEST(AdamW8bit, Float64ModelAgrees) {
  Stepper cpu("cpu", DType::f32), ref("ref", DType::f64);
  for (int k = 1; k <= 20; ++k) {
    cpu.step(k);
    ref.step(k);
  }
  for (size_t i = 0; i < cpu.set.size(); ++i)
    EXPECT_LE(test::rel_l2(test::tensor_f64(cpu.set[i].param), test::tensor_f64(ref.set[i].param)), 1e-6) << cpu.set[i].name;
  for (const char* n : {"m_absmax.odd", "v_absmax.odd", "m_absmax.even", "v_absmax.even"})
    EXPECT_LE(test::rel_l2(cpu.state_f64(n), ref.state_f64(n)), 1e-6) << n;
  // and against bitsandbytes (a different implementation of the same rules)
  for (const Trainable& t : ref.set)
    EXPECT_LE(test::rel_l2(test::tensor_f64(t.param), test::golden_f64(ref.g.f, "after20." + t.name)), 1e-6) << t.name;
}

// A NaN or infinite gradient element zeroes that element's m and v and leaves its parameter unchanged;
// the rest of its block is updated as usual (bitsandbytes' CUDA kernel).
TEST(AdamW8bit, NonFiniteGradientZeroesStateKeepsParameter) {
  for (const char* backend : {"cpu", "ref"}) {
    Stepper r(backend, std::string(backend) == "cpu" ? DType::f32 : DType::f64);
    r.step(1);
    r.step(2);
    const Trainable& t = r.set[2];  // "even", 8-bit
    const std::vector<double> before = test::tensor_f64(t.param);
    const std::vector<double> g3 = test::golden_f64(r.g.f, "grad3.even");
    std::vector<double> g = g3;
    g[5] = std::numeric_limits<double>::quiet_NaN();
    g[300] = std::numeric_limits<double>::infinity();
    g[301] = -std::numeric_limits<double>::infinity();
    for (Trainable& u : r.set) {
      const std::vector<double> v = test::golden_f64(r.g.f, "grad3." + u.name);
      convert(u.grad.data, u.grad.dtype, v.data(), DType::f64, u.grad.numel());
    }
    convert(t.grad.data, t.grad.dtype, g.data(), DType::f64, t.grad.numel());
    r.opt->step(*r.ops, r.set, r.g.lr[2], 3);
    const std::vector<double> after = test::tensor_f64(t.param);
    const std::vector<uint8_t> mc = r.codes("m.even"), vc = r.codes("v.even");
    const std::vector<double> ma = r.state_f64("m_absmax.even"), va = r.state_f64("v_absmax.even");
    for (int i : {5, 300, 301}) {
      EXPECT_EQ(after[static_cast<size_t>(i)], before[static_cast<size_t>(i)]) << backend << " element " << i;
      const size_t b = static_cast<size_t>(i) / kAdam8Block;
      // zero quantises to the code nearest the grid point above 0 (relative size under 1e-4 of the block)
      EXPECT_LE(std::fabs(dyn8::kSigned[mc[static_cast<size_t>(i)]] * ma[b]), 1e-4 * ma[b]) << backend << " m " << i;
      EXPECT_LE(std::fabs(dyn8::kUnsigned[vc[static_cast<size_t>(i)]] * va[b]), 1e-4 * va[b]) << backend << " v " << i;
    }
    EXPECT_NE(after[4], before[4]) << backend;
    EXPECT_NE(after[302], before[302]) << backend;
  }
}

// The AVX2 block kernel gives the portable one's bits: full and short blocks, all-zero and non-finite
// gradients, gradients whose square overflows (handed to the portable rules), states from earlier steps.
TEST(AdamW8bit, Avx2BlockKernelGivesThePortableBits) {
  if (!cpu::adam8_avx2_supported()) GTEST_SKIP() << "no AVX2 + FMA";
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> ud(-4, 2);
  const cpu::Adam8Scalars s{0.9f, 0.995f, 0.1f, 0.005f, 0.3f, -1e-3f, 1e-8f, 0.9999f, true};
  int blocks = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int64_t len = trial % 7 == 6 ? 1 + trial % 255 : kAdam8Block;
    std::vector<float> p(kAdam8Block), g(kAdam8Block);
    std::vector<uint8_t> mc(kAdam8Block), vc(kAdam8Block);
    float ma = trial % 5 == 0 ? 0.0f : std::pow(10.0f, ud(rng)), va = trial % 5 == 0 ? 0.0f : std::pow(10.0f, ud(rng));
    const float scale = std::pow(10.0f, ud(rng));
    for (int64_t k = 0; k < kAdam8Block; ++k) {
      p[k] = nd(rng);
      g[k] = trial % 11 == 3 ? 0.0f : scale * nd(rng);
      mc[k] = static_cast<uint8_t>(rng());
      vc[k] = static_cast<uint8_t>(rng());
    }
    if (trial % 13 == 4) g[rng() % len] = std::numeric_limits<float>::quiet_NaN();
    if (trial % 17 == 5) g[rng() % len] = -std::numeric_limits<float>::infinity();
    if (trial % 19 == 6) g[rng() % len] = 3e30f;  // g*g overflows: v is infinite
    std::vector<float> p2 = p;
    std::vector<uint8_t> mc2 = mc, vc2 = vc;
    float ma2 = ma, va2 = va;
    cpu::adam8_block_generic(s, p.data(), g.data(), mc.data(), &ma, vc.data(), &va, len);
    cpu::adam8_block_avx2(s, p2.data(), g.data(), mc2.data(), &ma2, vc2.data(), &va2, len);
    ASSERT_EQ(std::memcmp(p.data(), p2.data(), sizeof(float) * kAdam8Block), 0) << "trial " << trial;
    ASSERT_EQ(mc, mc2) << "trial " << trial;
    ASSERT_EQ(vc, vc2) << "trial " << trial;
    ASSERT_EQ(std::memcmp(&ma, &ma2, 4), 0) << "trial " << trial;
    ASSERT_EQ(std::memcmp(&va, &va2, 4), 0) << "trial " << trial;
    ++blocks;
  }
  EXPECT_EQ(blocks, 400);
}

TEST(AdamW8bit, StateBytesNamesAndDtypes) {
  Stepper r("cpu", DType::f32);
  // 8-bit tensors: one byte a moment and a float per 256 elements; fp32 ones: 4 bytes a moment.
  const int64_t big = 17 * 257 + 5120, blocks = (17 * 257 + 255) / 256 + 5120 / 256;
  const size_t expect = static_cast<size_t>(2 * big + 2 * 4 * blocks + 2 * 4 * 900);
  const size_t held = r.ledger.current(Tier::Host, Category::optimizer);
  EXPECT_GE(held, expect);
  EXPECT_LE(held, expect + 12 * 64);  // each tensor starts on a 64-byte boundary
  std::map<std::string, DType> names;
  for (const NamedTensor& t : r.opt->state()) names[t.name] = t.t.dtype;
  const std::map<std::string, DType> want = {
      {"m.odd", DType::u8},          {"v.odd", DType::u8},          {"m.even", DType::u8},
      {"v.even", DType::u8},         {"m_absmax.odd", DType::f32},  {"v_absmax.odd", DType::f32},
      {"m_absmax.even", DType::f32}, {"v_absmax.even", DType::f32}, {"m.small", DType::f32},
      {"v.small", DType::f32}};
  EXPECT_EQ(names, want);
  const json::Value s = r.opt->settings_json();
  EXPECT_EQ(s.at("optimizer").as_string(), "adamw8bit");
}

TEST(AdamW8bit, UnknownOptimizerIsRefusedByName) {
  try {
    parse_optimizer("adam9bit");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("--optim adam9bit"), std::string::npos) << m;
    EXPECT_NE(m.find("adamw8bit"), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace oomless
