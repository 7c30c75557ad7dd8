// Shared by chunked_test.cpp and chunked_slowtest.cpp: small models, token streams, and one training
// step (full-sequence or chunk-recurrent over a PagedKvStore) with its loss, gradients, ledger peaks and
// transfer counters.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/ops.h"
#include "memory/arena.h"
#include "model/model.h"
#include "kv/paged_kv.h"
#include "util/harness.h"

namespace oomless::test {

namespace fs = std::filesystem;

inline ModelConfig small_config() {
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

inline std::vector<Variant> variants() {
  std::vector<Variant> v;
  ModelConfig c = small_config();
  v.push_back({"llama_gqa", c});
  c.tied = true, c.Hkv = 4;
  v.push_back({"llama_mha_tied", c});
  c = small_config();
  c.qkv_bias = c.o_bias = true;
  c.rope.scaling = RopeScaling::llama3, c.rope.factor = 4.0, c.rope.original_max_position = 16.0;
  v.push_back({"llama_bias_llama3", c});
  c = small_config();
  c.arch = Arch::qwen3, c.qk_norm = true, c.D = 8;
  v.push_back({"qwen3", c});
  return v;
}

// A disk-backed folder for the spill file (the store refuses tmpfs): the build directory the tests run in.
inline std::string spill_dir() {
  if (const char* e = std::getenv("OOMLESS_TEST_SPILL_DIR")) return e;
  return fs::current_path().string();
}

struct Result {
  double loss_sum = 0;
  int64_t count = 0;
  std::vector<std::vector<float>> grads;  // per parameter tensor
  std::vector<std::string> names;
  size_t peak_activations = 0, peak_device = 0, peak_host = 0;
  size_t peak_kv = 0, peak_kv_grad = 0;  // every tier
  OffloadStats stats;
  std::vector<uint64_t> fetched;  // per chunk: bytes moved to Device from Host or Disk (both passes)
  std::vector<std::vector<int64_t>> selections;  // sparse: every (layer, chunk, query page) selection, in order
};

struct RunSetup {
  ModelConfig cfg;
  SavePolicy policy = SavePolicy::all;
  ComputeDType dtype = ComputeDType::f32;
  int64_t sparse_pages = 0, sink_pages = 1;
  PageSummary summary = PageSummary::mean;
  int64_t lora_r = 0;  // > 0: a LoRA of this rank on every projection (random A and B), base frozen
  double lora_dropout = 0;
  bool dora = false;    // the LoRA is a DoRA
  DType kv_dtype = DType::f32;  // storage of the history's keys and values
  DType act_store = DType::f32;  // storage of the saved activations (--act-dtype)
  std::vector<SavePolicy> layers{};  // a policy per layer (ModelOptions::save_layers), else `policy` for all
};

// LoRA settings on every projection of a block, alpha = 2r.
inline LoraSettings all_linear_lora(int64_t r) {
  LoraSettings s;
  s.r = r;
  s.alpha = 2.0 * static_cast<double>(r);
  s.targets = parse_lora_targets("all-linear");
  return s;
}

// Adapters with PEFT's init of A and a random (non-zero) B, so that every adapter gradient is non-zero.
inline std::unique_ptr<AdapterSet> random_adapters(const ModelConfig& cfg, const LoraSettings& s, DType dtype,
                                                   Arena& arena, uint64_t seed) {
  auto a = std::make_unique<AdapterSet>(cfg, s, dtype, arena, Category::adapter);
  init_lora(*make_ops("cpu"), *a, seed);  // (the host default upload: any dtype)
  std::mt19937_64 rng(seed + 1);
  std::uniform_real_distribution<double> u(-0.3, 0.3);
  for (size_t i = 0; i < a->tensors().specs().size(); ++i) {
    const std::string& name = a->tensors().specs()[i].name;
    const bool b = name.find("lora_B") != std::string::npos, m = name.find("lora_magnitude") != std::string::npos;
    if (!b && !m) continue;
    const Tensor& t = a->tensors().tensors()[i];
    std::vector<double> v(static_cast<size_t>(t.numel()));
    for (double& x : v) x = m ? 1.0 + 2 * u(rng) : u(rng);  // DoRA magnitudes: positive, around 1
    write_tensor(t, [&](void* h) { convert(h, t.dtype, v.data(), DType::f64, t.numel()); });
  }
  return a;
}

// A ChunkKv in front of a PagedKvStore that charges the store's transfers to the chunk they serve: the
// bytes moved to Device between one set_chunk and the next (or end) belong to the first one's chunk.
class RecordingKv final : public ChunkKv {
 public:
  explicit RecordingKv(PagedKvStore& s) : s_(s) {}
  void set_bf16_products(bool on) override { s_.set_bf16_products(on); }
  void begin(int64_t T, int64_t C) override {
    s_.begin(T, C);
    fetched.assign(static_cast<size_t>((T + C - 1) / C), 0);
    last_ = in();
    cur_ = 0;
  }
  void set_chunk(int64_t c) override {
    charge();
    cur_ = c;
    s_.set_chunk(c);
  }
  void store(int64_t layer, Tensor k, Tensor v) override { s_.store(layer, k, v); }
  void forward(int64_t layer, Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, Tensor pos) override {
    s_.forward(layer, o, lse, q, k, v, pos);
  }
  void backward(int64_t layer, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor o,
                Tensor lse, Tensor pos) override {
    s_.backward(layer, dq, dk, dv, dout, q, k, v, o, lse, pos);
  }
  void chunk_done(int64_t c) override {
    charge();
    s_.chunk_done(c);
  }
  void end() override {
    charge();
    s_.end();
  }
  std::vector<uint64_t> fetched;

 private:
  uint64_t in() const {
    const OffloadStats st = s_.stats();
    const int dev = static_cast<int>(Tier::Device);
    return st.bytes[static_cast<int>(Tier::Host)][dev] + st.bytes[static_cast<int>(Tier::Disk)][dev];
  }
  void charge() {
    const uint64_t now = in();
    if (cur_ < static_cast<int64_t>(fetched.size())) fetched[static_cast<size_t>(cur_)] += now - last_;
    last_ = now;
  }
  PagedKvStore& s_;
  uint64_t last_ = 0;
  int64_t cur_ = 0;
};

inline std::vector<int32_t> tokens(int64_t T, int64_t V, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (auto& x : ids) x = static_cast<int32_t>(rng() % static_cast<uint64_t>(V));
  return ids;
}

inline std::vector<int32_t> targets_of(const std::vector<int32_t>& ids) {
  std::vector<int32_t> tg(ids.size());
  for (size_t t = 0; t < ids.size(); ++t) tg[t] = t + 1 < ids.size() ? ids[t + 1] : -100;
  tg[ids.size() / 3] = -100;  // an unsupervised row inside some chunk
  return tg;
}

// C = 0: full sequence.
inline Result run(const RunSetup& s, std::vector<int32_t> ids, int64_t C, int64_t P, KvOffload mode) {
  CpuMemory mem(size_t{1} << 34);
  auto ops = make_ops("cpu", &mem.device);
  ParamSet params(s.cfg, DType::f32, mem.device, Category::weights);
  init_random(*ops, params, 5, 0.3);  // large weights: attention far from uniform, so history matters
  std::unique_ptr<AdapterSet> ad;
  if (s.lora_r > 0) {
    LoraSettings ls = all_linear_lora(s.lora_r);
    ls.dropout = s.lora_dropout;
    ls.dora = s.dora;
    ad = random_adapters(s.cfg, ls, DType::f32, mem.device, 17);
  }
  ModelOptions mo{s.dtype, s.policy, ad.get(), s.act_store};
  mo.save_layers = s.layers;
  Model m(s.cfg, *ops, params, mem.device, mo);
  m.set_dropout_seed(99);
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
    PagedKvOptions o{C, P, mode, spill_dir()};
    o.sparse_pages = s.sparse_pages, o.sink_pages = s.sink_pages, o.summary = s.summary;
    o.kv_dtype = s.kv_dtype;
    PagedKvStore kv(kv_dims(s.cfg), *ops, mem.device, mem.host, o, T, true);
    RecordingKv rec(kv);
    const CeResult ce = m.chunked_step(id_t, tg_t, C, rec, 1.0 / static_cast<double>(N));
    r.loss_sum = ce.loss_sum, r.count = ce.count;
    r.stats = kv.stats();
    r.fetched = rec.fetched;
    for (int64_t l = 0; l < s.cfg.L; ++l)
      for (int64_t c = 0; c * C < T; ++c)
        for (int64_t qp = 0; qp < C / P; ++qp) r.selections.push_back(kv.selection(l, c, qp));
    EXPECT_EQ(kv.pages_in_use(), 0) << "pages left after the step";
  }
  for (const Trainable& tr : m.trainable()) {
    const Tensor& t = tr.grad;
    r.names.push_back(tr.name);
    r.grads.push_back(tensor_values<float>(t));
  }
  r.peak_activations = mem.ledger.peak(Tier::Device, Category::activations);
  r.peak_device = mem.ledger.peak_total(Tier::Device);
  r.peak_host = mem.ledger.peak_total(Tier::Host);
  for (Tier t : {Tier::Device, Tier::Host, Tier::Disk}) {
    r.peak_kv += mem.ledger.peak(t, Category::kv);
    r.peak_kv_grad += mem.ledger.peak(t, Category::kv_grad);
  }
  return r;
}

inline double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline bool same_bits(const Result& a, const Result& b) {
  if (std::memcmp(&a.loss_sum, &b.loss_sum, sizeof(double)) != 0 || a.count != b.count) return false;
  for (size_t i = 0; i < a.grads.size(); ++i)
    if (std::memcmp(a.grads[i].data(), b.grads[i].data(), a.grads[i].size() * sizeof(float)) != 0) return false;
  return true;
}

// Runs chunked steps with the disk tier at each length of Ts and checks: equal activation peaks, Device +
// Host growth <= 0.5 MB per 1K tokens, disk traffic growing with T; and that without offload the Device
// peak does grow (so the comparison can fail).
inline void expect_flat_memory(const ModelConfig& cfg, std::vector<int64_t> Ts, int64_t C, int64_t P) {
  RunSetup s{cfg};
  std::vector<Result> rs;
  for (size_t i = 0; i < Ts.size(); ++i) rs.push_back(run(s, tokens(Ts[i], cfg.V, i + 1), C, P, KvOffload::disk));
  const Result &a = rs.front(), &c = rs.back();
  EXPECT_GT(a.peak_activations, 0u);
  for (const Result& r : rs) EXPECT_EQ(r.peak_activations, a.peak_activations);
  const double per_1k = (static_cast<double>(c.peak_device + c.peak_host) - static_cast<double>(a.peak_device + a.peak_host)) /
                        (static_cast<double>(Ts.back() - Ts.front()) / 1024.0);
  EXPECT_LE(per_1k, 0.5e6) << "Device+Host grows by " << per_1k << " bytes per 1K tokens";
  const int disk = static_cast<int>(Tier::Disk), dev = static_cast<int>(Tier::Device);
  EXPECT_GT(c.stats.bytes[disk][dev], 3 * a.stats.bytes[disk][dev]);
  const Result none = run(s, tokens(Ts.back(), cfg.V, Ts.size()), C, P, KvOffload::none);
  EXPECT_EQ(none.peak_activations, a.peak_activations);
  EXPECT_GT(none.peak_device, c.peak_device) << "without offload the history should be Device memory";
}

}  // namespace oomless::test
