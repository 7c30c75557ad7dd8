// Chunk-recurrent training (Model::chunked_step over a PagedKvStore) against full-sequence training:
// loss and every parameter gradient within fp32 tolerance for chunk lengths that do and do not divide T,
// several page lengths, GQA and MHA, biases, llama3 RoPE and Qwen3 norms; bitwise identical to the
// full sequence when one chunk covers it; bitwise identical across --kv-offload none/host/disk and across
// SavePolicies; chunked evaluation equal to the full forward; activation memory independent of T; and
// with the disk tier, Device + Host memory that does not grow with T beyond bookkeeping.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "backend/ops.h"
#include "memory/arena.h"
#include "model/model.h"
#include "model/paged_kv.h"

namespace oomless {
namespace {

namespace fs = std::filesystem;

ModelConfig small_config() {
  ModelConfig c;
  c.L = 2, c.E = 16, c.F = 24, c.H = 4, c.Hkv = 2, c.D = 6, c.V = 37;
  c.rms_eps = 1e-5;
  c.rope.theta = 500.0;
  c.max_position = 1 << 20;
  return c;
}

struct Variant {
  const char* name;
  ModelConfig cfg;
};

std::vector<Variant> variants() {
  std::vector<Variant> v;
  ModelConfig c = small_config();
  v.push_back({"llama_gqa", c});
  c.tied = true, c.Hkv = 4;
  v.push_back({"llama_mha_tied", c});
  c = small_config();
  c.qkv_bias = c.o_bias = true;
  c.rope.llama3 = true, c.rope.factor = 4.0, c.rope.original_max_position = 16.0;
  v.push_back({"llama_bias_llama3", c});
  c = small_config();
  c.arch = Arch::qwen3, c.qk_norm = true, c.D = 8;
  v.push_back({"qwen3", c});
  return v;
}

// A disk-backed folder for the spill file (the store refuses tmpfs): the build directory the tests run in.
std::string spill_dir() {
  if (const char* e = std::getenv("OOMLESS_TEST_SPILL_DIR")) return e;
  return fs::current_path().string();
}

struct Result {
  double loss_sum = 0;
  int64_t count = 0;
  std::vector<std::vector<float>> grads;  // per parameter tensor
  std::vector<std::string> names;
  size_t peak_activations = 0, peak_device = 0, peak_host = 0;
  OffloadStats stats;
};

struct RunSetup {
  ModelConfig cfg;
  SavePolicy policy = SavePolicy::all;
  ComputeDType dtype = ComputeDType::f32;
};

std::vector<int32_t> tokens(int64_t T, int64_t V, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (auto& x : ids) x = static_cast<int32_t>(rng() % static_cast<uint64_t>(V));
  return ids;
}

std::vector<int32_t> targets_of(const std::vector<int32_t>& ids) {
  std::vector<int32_t> tg(ids.size());
  for (size_t t = 0; t < ids.size(); ++t) tg[t] = t + 1 < ids.size() ? ids[t + 1] : -100;
  tg[ids.size() / 3] = -100;  // an unsupervised row inside some chunk
  return tg;
}

// C = 0: full sequence.
Result run(const RunSetup& s, std::vector<int32_t> ids, int64_t C, int64_t P, KvOffload mode) {
  CpuMemory mem(size_t{1} << 34);
  auto ops = make_ops("cpu", &mem.device);
  ParamSet params(s.cfg, DType::f32, mem.device, Category::weights);
  init_random(params, 5, 0.3);  // large weights: attention far from uniform, so history matters
  Model m(s.cfg, *ops, params, mem.device, {s.dtype, s.policy});
  const int64_t T = static_cast<int64_t>(ids.size());
  std::vector<int32_t> tg = targets_of(ids);
  int64_t N = 0;
  for (int32_t t : tg) N += t >= 0;
  Tensor id_t(ids.data(), DType::i32, {T}), tg_t(tg.data(), DType::i32, {T});
  Result r;
  mem.ledger.reset_peaks();
  if (C == 0) {
    m.reserve(T, true);
    const CeResult ce = m.forward(id_t, tg_t, true);
    m.backward(1.0 / static_cast<double>(N));
    r.loss_sum = ce.loss_sum, r.count = ce.count;
  } else {
    m.reserve(C, true, true);
    PagedKvStore kv(s.cfg, *ops, mem.device, mem.host, {C, P, mode, spill_dir()}, T, true);
    const CeResult ce = m.chunked_step(id_t, tg_t, C, kv, 1.0 / static_cast<double>(N));
    r.loss_sum = ce.loss_sum, r.count = ce.count;
    r.stats = kv.stats();
    EXPECT_EQ(kv.pages_in_use(), 0) << "pages left after the step";
  }
  const ParamSet& g = m.grads();
  for (size_t i = 0; i < g.specs().size(); ++i) {
    const Tensor& t = g.tensors()[i];
    r.names.push_back(g.specs()[i].name);
    r.grads.emplace_back(static_cast<const float*>(t.data), static_cast<const float*>(t.data) + t.numel());
  }
  r.peak_activations = mem.ledger.peak(Tier::Device, Category::activations);
  r.peak_device = mem.ledger.peak_total(Tier::Device);
  r.peak_host = mem.ledger.peak_total(Tier::Host);
  return r;
}

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

bool same_bits(const Result& a, const Result& b) {
  if (std::memcmp(&a.loss_sum, &b.loss_sum, sizeof(double)) != 0 || a.count != b.count) return false;
  for (size_t i = 0; i < a.grads.size(); ++i)
    if (std::memcmp(a.grads[i].data(), b.grads[i].data(), a.grads[i].size() * sizeof(float)) != 0) return false;
  return true;
}

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

TEST(ChunkedEval, EqualsTheFullForward) {
  const ModelConfig cfg = variants()[0].cfg;
  CpuMemory mem(size_t{1} << 32);
  auto ops = make_ops("cpu", &mem.device);
  ParamSet params(cfg, DType::f32, mem.device, Category::weights);
  init_random(params, 5, 0.3);
  Model m(cfg, *ops, params, mem.device);
  const int64_t T = 150;
  std::vector<int32_t> ids = tokens(T, cfg.V, 13), tg = targets_of(ids);
  Tensor id_t(ids.data(), DType::i32, {T}), tg_t(tg.data(), DType::i32, {T});
  m.reserve(T, false, true);
  const CeResult full = m.forward(id_t, tg_t, false);
  for (KvOffload mode : {KvOffload::none, KvOffload::disk}) {
    PagedKvStore kv(cfg, *ops, mem.device, mem.host, {40, 8, mode, spill_dir()}, T, false);
    const CeResult ch = m.chunked_eval(id_t, tg_t, 40, kv);
    EXPECT_EQ(ch.count, full.count);
    EXPECT_NEAR(ch.loss_sum, full.loss_sum, 1e-5 * std::abs(full.loss_sum)) << kv_offload_name(mode);
    PagedKvStore one(cfg, *ops, mem.device, mem.host, {160, 8, mode, spill_dir()}, T, false);
    const CeResult whole = m.chunked_eval(id_t, tg_t, 160, one);
    EXPECT_EQ(whole.loss_sum, full.loss_sum) << "one chunk is the full forward";
  }
}

// Activations are reserved for one chunk: the same peak for 1K and 16K tokens. With the history on disk,
// Device + Host peak grows by at most 0.5 MB per 1K tokens (here: not at all, bookkeeping lives outside
// the arenas), while the disk holds what grows.
TEST(ChunkedTraining, MemoryDoesNotGrowWithSequenceLength) {
  ModelConfig cfg = small_config();
  cfg.V = 64;
  RunSetup s{cfg};
  const Result a = run(s, tokens(1024, cfg.V, 1), 256, 64, KvOffload::disk);
  const Result b = run(s, tokens(4096, cfg.V, 2), 256, 64, KvOffload::disk);
  const Result c = run(s, tokens(16384, cfg.V, 3), 256, 64, KvOffload::disk);
  EXPECT_GT(a.peak_activations, 0u);
  EXPECT_EQ(a.peak_activations, c.peak_activations);
  EXPECT_EQ(a.peak_activations, b.peak_activations);
  const double per_1k = (static_cast<double>(c.peak_device + c.peak_host) - static_cast<double>(a.peak_device + a.peak_host)) /
                        15.0;
  EXPECT_LE(per_1k, 0.5e6) << "Device+Host grows by " << per_1k << " bytes per 1K tokens";
  EXPECT_GT(c.stats.bytes[static_cast<int>(Tier::Disk)][static_cast<int>(Tier::Device)],
            4 * a.stats.bytes[static_cast<int>(Tier::Disk)][static_cast<int>(Tier::Device)]);
  // Without offload the history's pages are Device memory that grows with T.
  const Result d = run(s, tokens(4096, cfg.V, 2), 256, 64, KvOffload::none);
  EXPECT_EQ(d.peak_activations, a.peak_activations);
  EXPECT_GT(d.peak_device, b.peak_device);
}

TEST(ChunkedTraining, BadChunkAndPageLengthsAreClearErrors) {
  const ModelConfig cfg = small_config();
  CpuMemory mem(size_t{1} << 30);
  auto ops = make_ops("cpu", &mem.device);
  try {
    PagedKvStore kv(cfg, *ops, mem.device, mem.host, {48, 20, KvOffload::none, ""}, 100, true);
    FAIL() << "P not dividing C was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("must divide the chunk length"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_kv_offload("ssd"), Error);
  try {
    PagedKvStore kv(cfg, *ops, mem.device, mem.host, {48, 16, KvOffload::disk, "/no/such/folder"}, 100, true);
    FAIL() << "a missing spill folder was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/no/such/folder"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace oomless
