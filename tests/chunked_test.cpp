// Chunk-recurrent training (Model::chunked_step over a PagedKvStore) against full-sequence training:
// loss and every parameter gradient within fp32 tolerance for chunk lengths that do and do not divide T,
// several page lengths, GQA and MHA, biases, llama3 RoPE and Qwen3 norms; bitwise identical to the
// full sequence when one chunk covers it; bitwise identical across --kv-offload none/host/disk and across
// SavePolicies; chunked evaluation equal to the full forward; activation memory independent of T; and
// with the disk tier, Device + Host memory that does not grow with T beyond bookkeeping.
#include "util/chunked_run.h"

#include <cstdio>
#include <limits>
#include <random>

namespace oomless::test {
namespace {

TEST(ChunkedTraining, MatchesFullSequenceTraining) {
  const int64_t T = 150;
  struct CP {
    int64_t C, P;
  };
  for (const Variant& v : variants()) {
    RunSetup s{v.cfg};
    const std::vector<int32_t> ids = tokens(T, v.cfg.V, 11);
    const Result full = run(s, ids, 0, 0, KvOffload::none);
    for (CP cp : {CP{32, 8}, CP{48, 16}, CP{64, 64}, CP{100, 25}, CP{149, 149}}) {
      SCOPED_TRACE(std::string(v.name) + " C=" + std::to_string(cp.C) + " P=" + std::to_string(cp.P));
      const Result ch = run(s, ids, cp.C, cp.P, KvOffload::none);
      EXPECT_EQ(ch.count, full.count);
      EXPECT_LE(std::abs(ch.loss_sum - full.loss_sum) / std::abs(full.loss_sum), 1e-5);
      for (size_t i = 0; i < full.grads.size(); ++i)
        EXPECT_LE(rel_l2(ch.grads[i], full.grads[i]), 1e-5) << full.names[i];
    }
    // One chunk covering the sequence is the full-sequence computation itself.
    EXPECT_TRUE(same_bits(run(s, ids, 160, 32, KvOffload::none), full)) << v.name << ": C >= T is not bitwise full";
  }
}

// The same chunk and page lengths give the same bits whether the history stays on Device, goes to Host
// RAM or to the spill file, and whatever the SavePolicy (fp32 and bf16 projections).
TEST(ChunkedTraining, BitwiseAcrossOffloadModesAndSavePolicies) {
  const int64_t T = 150;
  for (const Variant& v : {variants()[0], variants()[3]}) {
    for (ComputeDType dt : {ComputeDType::f32, ComputeDType::bf16}) {
      const std::vector<int32_t> ids = tokens(T, v.cfg.V, 12);
      const Result base = run({v.cfg, SavePolicy::all, dt}, ids, 32, 8, KvOffload::none);
      for (SavePolicy pol : {SavePolicy::all, SavePolicy::selective, SavePolicy::none})
        for (KvOffload mode : {KvOffload::none, KvOffload::host, KvOffload::disk}) {
          const Result r = run({v.cfg, pol, dt}, ids, 32, 8, mode);
          EXPECT_TRUE(same_bits(r, base)) << v.name << " " << save_policy_name(pol) << " " << kv_offload_name(mode)
                                          << (dt == ComputeDType::bf16 ? " bf16" : " fp32");
          RunSetup mixed{v.cfg, pol, dt};  // this policy on layer 0, the next one on layer 1
          mixed.layers = {pol, pol == SavePolicy::all ? SavePolicy::none : SavePolicy::all};
          EXPECT_TRUE(same_bits(run(mixed, ids, 32, 8, mode), base)) << v.name << " per layer " << save_policy_name(pol);
          if (mode != KvOffload::none) {
            // The history really moved: out to the tier and back in.
            const Tier t = mode == KvOffload::host ? Tier::Host : Tier::Disk;
            EXPECT_GT(r.stats.bytes[static_cast<int>(Tier::Device)][static_cast<int>(t)], 0u);
            EXPECT_GT(r.stats.bytes[static_cast<int>(t)][static_cast<int>(Tier::Device)], 0u);
          }
        }
    }
  }
}

// --kv-dtype bf16: the history's keys and values stored as bf16 in every tier. Bitwise the same across
// offload modes and SavePolicies, half the key/value bytes in each tier (gradients stay fp32), and close to
// the fp32 store: loss within 1e-3 and gradients within 2e-2 (relative L2), and not equal to it.
TEST(ChunkedTraining, Bf16KeyValuePagesHalveTheStoreAndStayClose) {
  const int64_t T = 150;
  for (const Variant& v : {variants()[0], variants()[3]}) {
    SCOPED_TRACE(v.name);
    const std::vector<int32_t> ids = tokens(T, v.cfg.V, 12);
    RunSetup f32{v.cfg};
    RunSetup b16{v.cfg};
    b16.kv_dtype = DType::bf16;
    for (KvOffload mode : {KvOffload::none, KvOffload::host, KvOffload::disk}) {
      SCOPED_TRACE(kv_offload_name(mode));
      const Result a = run(f32, ids, 32, 8, mode), b = run(b16, ids, 32, 8, mode);
      EXPECT_EQ(b.peak_kv * 2, a.peak_kv);
      EXPECT_EQ(b.peak_kv_grad, a.peak_kv_grad);
      EXPECT_GT(b.peak_kv_grad, 0u);
      EXPECT_LE(std::abs(b.loss_sum - a.loss_sum) / std::abs(a.loss_sum), 1e-3);
      EXPECT_NE(b.loss_sum, a.loss_sum) << "the pages were not rounded";
      for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_LE(rel_l2(b.grads[i], a.grads[i]), 2e-2) << a.names[i];
      if (mode == KvOffload::none) {
        for (SavePolicy pol : {SavePolicy::selective, SavePolicy::none}) {
          RunSetup p = b16;
          p.policy = pol;
          EXPECT_TRUE(same_bits(run(p, ids, 32, 8, KvOffload::none), b)) << save_policy_name(pol);
        }
      } else {
        EXPECT_TRUE(same_bits(b, run(b16, ids, 32, 8, KvOffload::none)));
      }
    }
  }
}

// --kv-dtype fp8: E4M3 pages with delayed scaling. Bitwise the same across offload modes and SavePolicies,
// a quarter of the key/value bytes (gradients stay fp32), and near the fp32 store (printed; bounds below).
TEST(ChunkedTraining, Fp8KeyValuePagesQuarterTheStoreAndStayNear) {
  const int64_t T = 150;
  for (const Variant& v : {variants()[0], variants()[3]}) {
    SCOPED_TRACE(v.name);
    const std::vector<int32_t> ids = tokens(T, v.cfg.V, 12);
    RunSetup f32{v.cfg};
    RunSetup f8{v.cfg};
    f8.kv_dtype = DType::f8_e4m3;
    const Result a = run(f32, ids, 32, 8, KvOffload::none), b = run(f8, ids, 32, 8, KvOffload::none);
    EXPECT_EQ(b.peak_kv * 4, a.peak_kv);
    EXPECT_EQ(b.peak_kv_grad, a.peak_kv_grad);
    const double dl = std::abs(b.loss_sum - a.loss_sum) / std::abs(a.loss_sum);
    double dg = 0;
    for (size_t i = 0; i < a.grads.size(); ++i) dg = std::max(dg, rel_l2(b.grads[i], a.grads[i]));
    std::printf("fp8 K/V, %s: loss %.3e relative, largest gradient difference %.3e (relative L2)\n", v.name, dl, dg);
    EXPECT_LE(dl, 1e-2);
    EXPECT_GT(dl, 0.0) << "the pages were not quantised";
    EXPECT_LE(dg, 0.25);
    for (KvOffload mode : {KvOffload::host, KvOffload::disk})
      EXPECT_TRUE(same_bits(run(f8, ids, 32, 8, mode), b)) << kv_offload_name(mode);
    for (SavePolicy pol : {SavePolicy::selective, SavePolicy::none}) {
      RunSetup p = f8;
      p.policy = pol;
      EXPECT_TRUE(same_bits(run(p, ids, 32, 8, KvOffload::none), b)) << save_policy_name(pol);
    }
  }
}

// Delayed scaling in the store itself: the first chunk is scaled by its own amax (nothing saturates), a
// later chunk twice as large by the history's (exactly the values scaled past 464 saturate), a chunk with a
// non-finite value is counted and kept out of the history, and the history survives amax_state/restore.
TEST(ChunkedKv, Fp8DelayedScalingCountsSaturationAndKeepsNonFiniteOut) {
  ModelConfig cfg = variants()[0].cfg;
  CpuMemory mem(size_t{1} << 32);
  auto ops = make_ops("cpu", &mem.device);
  const int64_t C = 16, P = 8, T = 4 * C, Hkv = cfg.Hkv, D = cfg.D;
  PagedKvOptions o{C, P, KvOffload::none, ""};
  o.kv_dtype = DType::f8_e4m3;
  PagedKvStore kv(kv_dims(cfg), *ops, mem.device, mem.host, o, T, false);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> k(static_cast<size_t>(Hkv * C * D)), v(k.size());
  kv.begin(T, C);
  auto store_kv = [&](int64_t c) {
    kv.set_chunk(c);
    std::vector<Buffer> keep;  // the chunk's keys and values where the store's kernels run
    const Tensor kd = test::arena_copy(mem.device, keep, k, DType::f32, {Hkv, C, D}),
                 vd = test::arena_copy(mem.device, keep, v, DType::f32, {Hkv, C, D});
    for (int64_t l = 0; l < cfg.L; ++l) kv.store(l, kd, vd);
  };
  auto store = [&](int64_t c, float mul) {
    for (size_t i = 0; i < k.size(); ++i) k[i] = nd(rng) * mul, v[i] = nd(rng);
    store_kv(c);
  };
  store(0, 1.0f);
  float amax0 = 0;
  for (float x : k) amax0 = std::max(amax0, std::fabs(x));
  Fp8Stats s = kv.fp8_stats();
  EXPECT_EQ(s.k.values, static_cast<uint64_t>(cfg.L) * k.size());
  EXPECT_EQ(s.k.saturated, 0u);
  store(1, 2.0f);
  uint64_t want = 0;
  for (float x : k) want += std::fabs(x * (448.0f / amax0)) > 464.0f;
  EXPECT_GT(want, 0u);
  s = kv.fp8_stats();
  EXPECT_EQ(s.k.saturated, static_cast<uint64_t>(cfg.L) * want);
  EXPECT_EQ(s.k.nonfinite_chunks, 0u);
  const json::Value before = kv.amax_state();
  for (size_t i = 0; i < k.size(); ++i) k[i] = nd(rng);
  k[5] = std::numeric_limits<float>::infinity();
  store_kv(2);
  s = kv.fp8_stats();
  EXPECT_EQ(s.k.nonfinite_chunks, static_cast<uint64_t>(cfg.L));
  EXPECT_EQ(s.v.nonfinite_chunks, 0u);
  const json::Value after = kv.amax_state();
  for (int64_t l = 0; l < cfg.L; ++l)  // the keys' history did not take the infinite chunk; the values' did grow
    EXPECT_EQ(json::dump(after.as_array()[static_cast<size_t>(2 * l)]), json::dump(before.as_array()[static_cast<size_t>(2 * l)]));
  kv.end();
  PagedKvStore other(kv_dims(cfg), *ops, mem.device, mem.host, o, T, false);
  other.restore_amax(after);
  EXPECT_EQ(json::dump(other.amax_state()), json::dump(after));
  EXPECT_THROW(other.restore_amax(json::parse("[[1]]")), Error);
}

TEST(ChunkedEval, EqualsTheFullForward) {
  const ModelConfig cfg = variants()[0].cfg;
  CpuMemory mem(size_t{1} << 32);
  auto ops = make_ops("cpu", &mem.device);
  ParamSet params(cfg, DType::f32, mem.device, Category::weights);
  init_random(*ops, params, 5, 0.3);
  Model m(cfg, *ops, params, mem.device);
  const int64_t T = 150;
  std::vector<int32_t> ids = tokens(T, cfg.V, 13), tg = targets_of(ids);
  Tensor id_t(ids.data(), DType::i32, {T}), tg_t(tg.data(), DType::i32, {T});
  m.reserve(T, false, true);
  const CeResult full = m.forward(id_t, tg_t, false);
  for (KvOffload mode : {KvOffload::none, KvOffload::disk}) {
    PagedKvStore kv(kv_dims(cfg), *ops, mem.device, mem.host, {40, 8, mode, spill_dir()}, T, false);
    const CeResult ch = m.chunked_eval(id_t, tg_t, 40, kv);
    EXPECT_EQ(ch.count, full.count);
    EXPECT_NEAR(ch.loss_sum, full.loss_sum, 1e-5 * std::abs(full.loss_sum)) << kv_offload_name(mode);
    PagedKvStore one(kv_dims(cfg), *ops, mem.device, mem.host, {160, 8, mode, spill_dir()}, T, false);
    const CeResult whole = m.chunked_eval(id_t, tg_t, 160, one);
    EXPECT_EQ(whole.loss_sum, full.loss_sum) << "one chunk is the full forward";
  }
}

// Activations are reserved for one chunk: the same peak whatever T. With the history on disk, Device +
// Host peak grows by at most 0.5 MB per 1K tokens (here: not at all; bookkeeping lives outside the
// arenas), while the disk holds what grows. (chunked_slowtest.cpp repeats this at 1K, 4K and 16K tokens.)
TEST(ChunkedTraining, MemoryDoesNotGrowWithSequenceLength) {
  ModelConfig cfg = small_config();
  cfg.V = 64;
  expect_flat_memory(cfg, {512, 1024, 2048}, 128, 32);
}

TEST(ChunkedTraining, BadChunkAndPageLengthsAreClearErrors) {
  const ModelConfig cfg = small_config();
  CpuMemory mem(size_t{1} << 30);
  auto ops = make_ops("cpu", &mem.device);
  try {
    PagedKvStore kv(kv_dims(cfg), *ops, mem.device, mem.host, {48, 20, KvOffload::none, ""}, 100, true);
    FAIL() << "P not dividing C was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("must divide the chunk length"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_kv_offload("ssd"), Error);
  try {
    PagedKvStore kv(kv_dims(cfg), *ops, mem.device, mem.host, {48, 16, KvOffload::disk, "/no/such/folder"}, 100, true);
    FAIL() << "a missing spill folder was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/no/such/folder"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace oomless::test
