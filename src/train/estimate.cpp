#include "train/estimate.h"

#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <functional>

#include "backend/lapack.h"
#include "core/error.h"
#include "dist/comm.h"
#include "dist/ring_kv.h"
#include "model/act_store.h"
#include "model/lora.h"
#include "model/model.h"
#include "kv/paged_kv.h"
#include "model/quant_base.h"
#include "optim/adamw8bit.h"
#include "optim/galore.h"
#include "quant/bnb4.h"
#include "quant/nf4.h"

namespace oomless {

namespace {

constexpr int kDev = static_cast<int>(Tier::Device), kHost = static_cast<int>(Tier::Host),
              kDisk = static_cast<int>(Tier::Disk);

size_t a64(size_t n) { return (n + 63) / 64 * 64; }
int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}
size_t nbytes(DType t, int64_t n) { return static_cast<size_t>(dtype_bytes(t, n)); }

// A ParamSet's one allocation: each tensor on a 64-byte boundary, at least one byte.
size_t set_bytes(const std::vector<ParamSpec>& specs, DType t) {
  size_t total = 0;
  for (const ParamSpec& s : specs) total += a64(nbytes(t, numel(s.shape)));
  return std::max<size_t>(total, 1);
}

bool layer_matrix(const ParamSpec& s) { return s.shape.size() == 2 && s.name.rfind("model.layers.", 0) == 0; }

// An optimizer's state over `tr` (the trained tensors) as its sets allocate it (`arena`: 64-byte aligned
// sets, scratch included) and as its state tensors hold it (`state`: what a state file stores).
struct OptimBytes {
  size_t arena = 0, state = 0;
  std::vector<std::array<int64_t, 2>> projected;  // GaLore: the (m, n) of each projected matrix (SVD, products)
  int64_t rank = 0;
};

OptimBytes adamw_bytes(const std::vector<ParamSpec>& tr) {
  std::vector<ParamSpec> mv = tr;
  OptimBytes b;
  b.arena = 2 * set_bytes(mv, DType::f32);
  for (const ParamSpec& s : tr) b.state += 2 * nbytes(DType::f32, numel(s.shape));
  return b;
}

OptimBytes adamw8bit_bytes(const std::vector<ParamSpec>& tr) {
  std::vector<ParamSpec> codes, scales, small;
  OptimBytes b;
  for (const ParamSpec& s : tr) {
    const int64_t n = numel(s.shape);
    if (n >= AdamW8bit::kMin8bitElements) {
      const std::vector<int64_t> blocks{(n + kAdam8Block - 1) / kAdam8Block};
      for (int k = 0; k < 2; ++k) codes.push_back({s.name, s.shape, true}), scales.push_back({s.name, blocks, true});
      b.state += 2 * nbytes(DType::u8, n) + 2 * nbytes(DType::f32, blocks[0]);
    } else {
      for (int k = 0; k < 2; ++k) small.push_back(s);
      b.state += 2 * nbytes(DType::f32, n);
    }
  }
  b.arena = set_bytes(codes, DType::u8) + set_bytes(scales, DType::f32) + set_bytes(small, DType::f32);
  return b;
}

OptimBytes optim_bytes(const std::string& name, const std::vector<ParamSpec>& tr, int64_t rank) {
  if (name == "adamw") return adamw_bytes(tr);
  if (name == "adamw8bit") return adamw8bit_bytes(tr);
  const bool eight = name == "galore8bit";
  std::vector<ParamSpec> pspecs, mspecs, cspecs, sspecs, rest;
  OptimBytes b;
  b.rank = rank;
  int64_t most = 1;
  for (const ParamSpec& s : tr) {
    if (!layer_matrix(s)) {
      rest.push_back(s);
      continue;
    }
    const int64_t m = s.shape[0], n = s.shape[1];
    OOM_CHECK(rank <= std::min(m, n), "[estimate] --galore-rank ", rank, " is above the smaller side of ", s.name, " (",
              m, " x ", n, "): use --galore-rank ", std::min(m, n), " or less");
    const bool right = m >= n;
    const std::vector<int64_t> low = right ? std::vector<int64_t>{m, rank} : std::vector<int64_t>{rank, n};
    const int64_t low_n = numel(low);
    most = std::max(most, low_n);
    pspecs.push_back({s.name, right ? std::vector<int64_t>{rank, n} : std::vector<int64_t>{m, rank}, false});
    b.state += nbytes(DType::f32, rank * (right ? n : m));
    if (eight && low_n >= AdamW8bit::kMin8bitElements) {
      const std::vector<int64_t> blocks{(low_n + kAdam8Block - 1) / kAdam8Block};
      for (int k = 0; k < 2; ++k) cspecs.push_back({s.name, low, false}), sspecs.push_back({s.name, blocks, false});
      b.state += 2 * nbytes(DType::u8, low_n) + 2 * nbytes(DType::f32, blocks[0]);
    } else {
      for (int k = 0; k < 2; ++k) mspecs.push_back({s.name, low, false});
      b.state += 2 * nbytes(DType::f32, low_n);
    }
    b.projected.push_back({m, n});
  }
  b.arena = set_bytes(pspecs, DType::f32) + set_bytes(mspecs, DType::f32) + set_bytes(cspecs, DType::u8) +
            set_bytes(sspecs, DType::f32) + nbytes(DType::f32, 2 * most);
  if (!rest.empty()) {
    const OptimBytes r = eight ? adamw8bit_bytes(rest) : adamw_bytes(rest);
    b.arena += r.arena;
    b.state += r.state;
  }
  return b;
}

// --optim-state disk (optim/disk_state.h): the state file on Disk, and a window of three pieces' optimizers on
// Device, each piece one tensor or a run of a splittable one (pieces of at least 2^20 elements, in 256s).
void disk_optim(const std::string& name, const std::vector<ParamSpec>& tr, int64_t rank, size_t* file, size_t* window) {
  constexpr int64_t kMinPiece = int64_t{1} << 20, kBlock = 256, kWindow = 3;
  constexpr size_t kSlack = 64 * 16;
  const bool galore = name.rfind("galore", 0) == 0;
  auto splittable = [&](const ParamSpec& s) { return !galore || !layer_matrix(s); };
  int64_t piece = kMinPiece;
  for (const ParamSpec& s : tr)
    if (!splittable(s)) piece = std::max(piece, numel(s.shape));
  piece = (piece + kBlock - 1) / kBlock * kBlock;
  size_t slot = 0, total = 0;
  for (const ParamSpec& s : tr) {
    const int64_t n = numel(s.shape);
    std::vector<int64_t> counts;
    if (splittable(s) && n >= 2 * piece) {
      const int64_t k = n / piece;
      for (int64_t j = 0; j < k; ++j) counts.push_back(j + 1 < k ? piece : n - j * piece);
    } else {
      counts.push_back(-1);  // the whole tensor, in its own shape
    }
    for (int64_t c : counts) {
      const ParamSpec one{s.name, c < 0 ? s.shape : std::vector<int64_t>{c}, s.decay};
      const OptimBytes b = optim_bytes(name, {one}, rank);
      slot = std::max(slot, b.arena + kSlack);
      total += b.state;
    }
  }
  *file = std::max<size_t>(total, 1);
  *window = static_cast<size_t>(kWindow) * slot;
}

// The activation buffers Model::reserve takes (model/model.cpp), by what it reserves them for.
struct ModelShape {
  const ModelConfig* cfg = nullptr;
  bool bf16 = false;       // --dtype bf16
  DType store = DType::f32;  // --act-dtype (saved per-layer tensors)
  int64_t r = 0;           // LoRA rank (0: none)
  std::vector<Proj> targets;
  bool dora = false;
  double dropout = 0;
  std::vector<SavePolicy> policies;
  std::vector<Tier> tiers;  // where each layer's saved set waits (--act-offload)
};

// One set of a layer's block tensors (act_set in Model::reserve) in `dt` (row statistics in f32), each
// rounded up to `align` bytes.
size_t act_set_bytes(const ModelShape& m, int64_t T, bool backward, bool everything, SavePolicy policy, DType dt,
                     size_t align) {
  const ModelConfig& c = *m.cfg;
  const int64_t E = c.E, F = c.F, H = c.H, Hkv = c.Hkv, D = c.D;
  const bool all = everything || policy == SavePolicy::all;
  size_t n = 0;
  auto take = [&](bool keep, DType t, int64_t elems) {
    if (keep) n += (nbytes(t, elems) + align - 1) / align * align;
  };
  const DType f = DType::f32;
  take(all, dt, T * E), take(all, f, T);                                 // h1, rstd1
  take(c.qk_norm, dt, T * H * D), take(c.qk_norm && all, f, T * H);      // q_pre, q_rstd
  take(c.qk_norm, dt, Hkv * T * D), take(c.qk_norm && all, f, Hkv * T);  // k_pre, k_rstd
  take(true, dt, T * H * D), take(true, dt, Hkv * T * D), take(true, dt, Hkv * T * D);  // q, k, v
  take(true, dt, T * H * D), take(true, f, H * T), take(true, dt, T * E);  // o, lse, x_mid
  take(all, dt, T * E), take(all, f, T);                                   // h2, rstd2
  take(true, dt, T * F), take(true, dt, T * F), take(all, dt, T * F);      // gate, up, act
  for (size_t i = 0; i < m.targets.size(); ++i) take(m.r > 0, dt, T * m.r);  // LoRA u
  for (Proj p : m.targets)                                                 // DoRA z (training)
    take(m.dora && backward, dt, p == Proj::k || p == Proj::v ? Hkv * T * D : T * proj_out(c, p));
  return n;
}

// Model::reserve(T, backward, chunked): activations and the model's own workspace, and (with --act-offload)
// the Host / Disk copies.
struct ModelBytes {
  size_t act_device = 0, act_host = 0, act_disk = 0, workspace = 0;
};

ModelBytes model_bytes(const ModelShape& m, int64_t T, bool backward, bool chunked) {
  const ModelConfig& c = *m.cfg;
  const int64_t E = c.E, F = c.F, H = c.H, Hkv = c.Hkv, D = c.D, L = c.L;
  const DType f = DType::f32;
  const DType nd = backward && m.store != DType::f32 ? m.store : f;
  ModelBytes b;
  size_t& ws = b.workspace;
  ws += 4 * nbytes(DType::i32, T);  // positions, ones, ids, targets
  ws += act_set_bytes(m, T, backward, true, SavePolicy::all, f, 1);
  b.act_device += static_cast<size_t>(backward ? L + 1 : 2) * nbytes(f, T * E);  // the residual stream
  bool keeps = chunked;
  for (SavePolicy p : m.policies) keeps = keeps || p != SavePolicy::none;
  // The layers whose sets leave Device (in order): the i-th shares ring set i % 2; all but the last two wait in
  // a Host buffer or a spill slot of the largest set's size.
  std::vector<int64_t> out;
  for (int64_t l = 0; backward && !chunked && l < L; ++l)
    if (m.tiers[static_cast<size_t>(l)] != Tier::Device && m.policies[static_cast<size_t>(l)] != SavePolicy::none)
      out.push_back(l);
  const int64_t K = static_cast<int64_t>(out.size()), R = std::min(kActRing, K);
  std::vector<size_t> ring(static_cast<size_t>(std::max<int64_t>(R, 1)), 0), layer(static_cast<size_t>(L), 0);
  for (int64_t i = 0; i < K; ++i) {
    const int64_t l = out[static_cast<size_t>(i)];
    layer[static_cast<size_t>(l)] = act_set_bytes(m, T, backward, false, m.policies[static_cast<size_t>(l)], nd, 64);
    ring[static_cast<size_t>(i % R)] = std::max(ring[static_cast<size_t>(i % R)], layer[static_cast<size_t>(l)]);
  }
  if (K > 0)
    for (size_t x : ring) b.act_device += x;
  const size_t largest = *std::max_element(ring.begin(), ring.end());
  for (int64_t i = 0; i < K - R; ++i) {
    const int64_t l = out[static_cast<size_t>(i)];
    if (m.tiers[static_cast<size_t>(l)] == Tier::Host) b.act_host += layer[static_cast<size_t>(l)];
    else b.act_disk += largest;
  }
  for (int64_t l = 0; backward && keeps && l < L; ++l) {
    if (std::find(out.begin(), out.end(), l) != out.end()) continue;
    const SavePolicy p = m.policies[static_cast<size_t>(l)];
    if (p != SavePolicy::none) b.act_device += act_set_bytes(m, T, backward, false, p, nd, 1);
    else if (chunked) b.act_device += nbytes(nd, T * H * D) + nbytes(f, H * T);  // o, lse
  }
  b.act_device += nbytes(f, T * E) + 2 * nbytes(f, T);  // final norm, its rstd, the loss's lse
  ws += nbytes(f, T * E);                                // proj
  const int64_t wide = T * std::max({E, F, H * D});
  if (backward) {
    ws += 3 * nbytes(f, T * E) + 3 * nbytes(f, T * H * D) + 3 * nbytes(f, Hkv * T * D) + 3 * nbytes(f, T * F);
    if (c.qk_norm) ws += nbytes(f, std::max(T * H, Hkv * T) * D);
    if (m.r > 0) ws += 2 * nbytes(f, T * m.r);
    if (m.dropout > 0) ws += nbytes(f, wide);
    bool dz = false;
    for (Proj p : m.targets) dz = dz || (m.dora && (p == Proj::o || p == Proj::down));
    if (dz) ws += nbytes(f, T * E);
  }
  if (m.dropout > 0) ws += nbytes(f, wide);
  if (m.dropout > 0 && m.dora) ws += nbytes(f, wide) * (backward ? 3 : 1);
  if (m.bf16) {
    for (int i = 0; i < 5; ++i) {
      const bool big = i < 2 || i == 4;
      if (i < 2 || (m.r > 0 && i < 4) || (i == 4 && m.dropout > 0))
        ws += nbytes(DType::bf16, big ? wide : T * m.r);
    }
  }
  return b;
}

// The products (M, N, K) a training pass of T tokens runs through matmul: every projection forward and
// backward, the biases' gradients, LoRA's, DoRA's norms.
std::vector<std::array<int64_t, 3>> model_products(const ModelShape& m, int64_t T, bool full) {
  const ModelConfig& c = *m.cfg;
  std::vector<std::array<int64_t, 3>> v;
  for (int pi = 0; pi < kProjCount; ++pi) {
    const Proj p = static_cast<Proj>(pi);
    const int64_t N = proj_out(c, p), K = proj_in(c, p), r = m.r;
    v.push_back({T, N, K});
    v.push_back({T, K, N});
    if (full) v.push_back({N, K, T});
    const bool bias = p == Proj::o ? c.o_bias : (p == Proj::q || p == Proj::k || p == Proj::v) && c.qkv_bias;
    if (full && bias) v.push_back({1, N, T});  // db = ones^T dy
    if (r > 0 && std::find(m.targets.begin(), m.targets.end(), p) != m.targets.end()) {
      for (auto x : {std::array<int64_t, 3>{T, r, K}, {T, N, r}, {N, r, T}, {T, r, N}, {r, K, T}, {T, K, r}}) v.push_back(x);
      if (m.dora) v.push_back({r, N, K}), v.push_back({r, r, K}), v.push_back({N, r, r});
    }
  }
  return v;
}

// Bytes of one quantised GGUF matrix as QuantBase keeps it (its rows of whole blocks).
size_t gguf_bytes(const GgufHfTensor& t) {
  const GgmlTypeInfo* ti = ggml_type_info(static_cast<uint32_t>(t.src->type));
  OOM_CHECK(ti && t.shape.size() == 2 && t.shape[1] % ti->block_size == 0, "[estimate] ", t.hf_name,
            ": a GGUF tensor of an unreadable type or shape");
  return static_cast<size_t>(t.shape[0] * (t.shape[1] / ti->block_size * ti->type_size));
}

}  // namespace

size_t MemoryEstimate::category(Category c) const {
  size_t n = 0;
  for (int t = 0; t < kTierCount; ++t) n += bytes[static_cast<size_t>(t)][static_cast<size_t>(c)];
  return n;
}

size_t MemoryEstimate::static_bytes() const {
  return category(Category::weights) + category(Category::grads) + category(Category::optimizer) +
         category(Category::adapter);
}

size_t MemoryEstimate::dynamic_bytes() const {
  return category(Category::activations) + category(Category::kv) + category(Category::kv_grad) +
         category(Category::workspace);
}

json::Value MemoryEstimate::json() const {
  json::Value o = json::Value::object();
  for (int t = 0; t < kTierCount; ++t) {
    json::Value tier = json::Value::object();
    for (int ci = 0; ci < kCategoryCount; ++ci)
      tier.set(category_name(static_cast<Category>(ci)),
               json::Value::integer(static_cast<int64_t>(bytes[static_cast<size_t>(t)][static_cast<size_t>(ci)])));
    tier.set("peak", json::Value::integer(static_cast<int64_t>(tier_peak[static_cast<size_t>(t)])));
    o.set(tier_name(static_cast<Tier>(t)), std::move(tier));
  }
  o.set("static", json::Value::integer(static_cast<int64_t>(static_bytes())));
  o.set("dynamic", json::Value::integer(static_cast<int64_t>(dynamic_bytes())));
  o.set("ram_peak", json::Value::integer(static_cast<int64_t>(ram_peak())));
  return o;
}

std::string MemoryEstimate::line() const {
  std::string out;
  for (int ci = 0; ci < kCategoryCount; ++ci) {
    const size_t b = category(static_cast<Category>(ci));
    if (b) out += (out.empty() ? "" : ", ") + std::string(category_name(static_cast<Category>(ci))) + " " + format_bytes(b);
  }
  return out;
}

std::string MemoryEstimate::table() const {
  char line[160];
  std::string out;
  std::snprintf(line, sizeof line, "  %-12s %12s %12s %12s\n", "", "device", "host", "disk");
  out += line;
  for (int ci = 0; ci < kCategoryCount; ++ci) {
    const Category c = static_cast<Category>(ci);
    if (category(c) == 0) continue;
    std::string cells[kTierCount];
    for (int t = 0; t < kTierCount; ++t) {
      const size_t n = bytes[static_cast<size_t>(t)][static_cast<size_t>(ci)];
      cells[t] = n ? format_bytes(n) : "-";
    }
    std::snprintf(line, sizeof line, "  %-12s %12s %12s %12s\n", category_name(c), cells[0].c_str(), cells[1].c_str(),
                  cells[2].c_str());
    out += line;
  }
  std::string peaks[kTierCount];
  for (int t = 0; t < kTierCount; ++t) peaks[t] = tier_peak[static_cast<size_t>(t)] ? format_bytes(tier_peak[static_cast<size_t>(t)]) : "-";
  std::snprintf(line, sizeof line, "  %-12s %12s %12s %12s\n", "peak", peaks[0].c_str(), peaks[1].c_str(), peaks[2].c_str());
  out += line;
  return out;
}

EstimateRanks this_process_ranks() { return {dist::size(), dist::rank()}; }

MemoryEstimate estimate_training(const TrainConfig& c, const ModelSource& src, const Ops& ops, EstimateRanks ranks) {
  validate_config(c);
  const EngineOptions eo = engine_options(c);
  const ModelConfig& cfg = src.cfg;
  const int64_t L = cfg.L, E = cfg.E, V = cfg.V;
  const DType f = DType::f32;
  MemoryEstimate est;
  auto add = [&](int tier, Category cat, size_t n) { est.bytes[static_cast<size_t>(tier)][static_cast<size_t>(cat)] += n; };
  const std::vector<ParamSpec> specs = param_specs(cfg);

  // Weights, as load_base holds them (model/quant_base.cpp).
  const bool adapters = c.lora > 0;
  const bool nf4 = eo.base_dtype != "fp32";
  const bool gguf_q = adapters && src.gguf_tensors;
  const bool gguf_tables = gguf_q && eo.embed_dtype == "auto";
  const bool convert_tables = eo.embed_dtype == "bf16" || eo.embed_dtype == "nf4";
  OOM_CHECK(!nf4 || !src.gguf_tensors, "[estimate] ", c.model, " is a GGUF, already quantised in its own blocks; "
            "--base-dtype ", eo.base_dtype, " takes a Hugging Face folder or a preset");
  const bool quant_proj = (adapters && (src.bnb4 || gguf_q)) || nf4;
  const bool tables_elsewhere = gguf_tables || convert_tables;
  std::vector<ParamSpec> f32_slots;
  for (const ParamSpec& s : specs) {
    const bool proj = is_projection_weight(s.name), table = is_embedding_or_head(s.name);
    if ((quant_proj && proj) || (tables_elsewhere && table)) continue;
    f32_slots.push_back(s);
  }
  // --zero 3 over several ranks: this rank's share of the layers' tensors (trained, or an adapter run's frozen f32
  // base), the rest whole, and one layer's storage the others are gathered into, or two (load_base's `held`).
  // The rank owning each parameter under --zero 2 and 3 (full training: the trained tensors are specs).
  const bool zero3 = c.zero >= 3 && ranks.size > 1;
  OOM_CHECK(!zero3 || (!quant_proj && !tables_elsewhere), "[estimate] --zero 3 shards an f32 base's layer weights over "
            "the ranks; this base is kept quantised, which is not sharded: use --zero 1");
  std::vector<int> spec_owner;
  if ((c.zero >= 2 && ranks.size > 1 && !adapters) || zero3) {
    std::vector<int64_t> sizes;
    for (const ParamSpec& s : specs) sizes.push_back(numel(s.shape));
    spec_owner = dist::owners(sizes, ranks.size);
  }
  size_t gathered = 0, zero3_wire = 0;
  if (zero3) {
    std::vector<ParamSpec> kept, layer0;
    for (size_t i = 0; i < specs.size(); ++i) {
      const int64_t layer = layer_of_name(specs[i].name);
      if (layer < 0 || spec_owner[i] == ranks.rank) kept.push_back(specs[i]);
      if (layer == 0) layer0.push_back(specs[i]);
    }
    f32_slots = kept;
    gathered = set_bytes(layer0, f) * static_cast<size_t>(eo.gathered_copies);
    // bf16 compute: a layer's projection weights travel in bf16 through a buffer per copy (Trainer::State::wire).
    if (eo.dtype == ComputeDType::bf16) {
      size_t wire = 0;
      for (const ParamSpec& s : layer0)
        if (is_projection_weight(s.name)) wire += a64(static_cast<size_t>(numel(s.shape)) * 2);
      zero3_wire = wire * static_cast<size_t>(eo.gathered_copies);
    }
  }
  size_t weights = set_bytes(f32_slots, f) + gathered, quant = 0;
  for (const ParamSpec& s : specs) {
    const bool proj = is_projection_weight(s.name), table = is_embedding_or_head(s.name);
    if (gguf_q) continue;
    if (proj && quant_proj) {
      if (src.bnb4) {
        const std::string prefix = s.name.substr(0, s.name.size() - std::string(".weight").size());
        quant += nf4::storage_bytes(load_bnb4_weight(*src.bnb4, prefix));
      } else if (eo.base_dtype == "bf16") {
        quant += nbytes(DType::bf16, numel(s.shape));
      } else {
        quant += nf4::storage_bytes(s.shape[0], s.shape[1], 64, eo.base_dtype == "nf4-dq");
      }
    } else if (table && convert_tables) {
      quant += eo.embed_dtype == "bf16" ? nbytes(DType::bf16, numel(s.shape))
                                        : nf4::storage_bytes(s.shape[0], s.shape[1], 64, eo.base_dtype == "nf4-dq");
    }
  }
  if (gguf_q)
    for (const GgufHfTensor& t : *src.gguf_tensors) {
      const bool proj = is_projection_weight(t.hf_name), table = is_embedding_or_head(t.hf_name);
      if (!proj && !(gguf_tables && table)) continue;
      if (table && cfg.tied && t.hf_name == "lm_head.weight") continue;  // the embedding serves
      quant += gguf_bytes(t);
    }
  weights += quant;
  add(kDev, Category::weights, weights);
  // A preset quantised at load draws its f32 init whole first (a workspace buffer, freed before the run).
  const size_t load_workspace = src.kind == "preset" && adapters && !src.bnb4 && (nf4 || convert_tables)
                                    ? set_bytes(specs, f) : 0;

  // Adapters and what trains.
  ModelShape ms;
  ms.cfg = &cfg;
  ms.bf16 = eo.dtype == ComputeDType::bf16;
  ms.store = eo.act_store == DType::f32 ? DType::f32 : eo.act_store;
  ms.policies = parse_save_policies(c.save_policy, L);
  ms.tiers = parse_act_tiers(c.act_offload, L);
  std::vector<ParamSpec> trained;
  bool head_trained = true;
  size_t workspace_fixed = 0;
  if (adapters) {
    const LoraSettings& ls = *eo.lora;
    validate_lora(ls, cfg);
    ms.r = ls.r, ms.targets = ls.targets, ms.dora = ls.dora, ms.dropout = ls.dropout;
    const std::vector<ParamSpec> aspecs = adapter_specs(cfg, ls);
    add(kDev, Category::adapter, set_bytes(aspecs, f));
    const bool embed = ls.train_embed || (cfg.tied && ls.train_head), head = ls.train_head && !cfg.tied;
    head_trained = ls.train_head || (cfg.tied && ls.train_embed);
    std::vector<ParamSpec> sspecs;
    if (embed) sspecs.push_back({"model.embed_tokens.weight", {V, E}, true});
    if (head) sspecs.push_back({"lm_head.weight", {V, E}, true});
    add(kDev, Category::grads, set_bytes(aspecs, f) + (sspecs.empty() ? 0 : set_bytes(sspecs, f)));
    trained = aspecs;
    for (const ParamSpec& s : sspecs) trained.push_back(s);
    if (ls.dora) {
      int64_t max_n = 0;
      for (Proj p : ls.targets) max_n = std::max(max_n, proj_out(cfg, p));
      workspace_fixed += nbytes(f, ls.r * max_n) + nbytes(f, ls.r * ls.r) + nbytes(f, max_n * ls.r);
      size_t norms = 0;
      for (Proj p : ls.targets) norms += nbytes(f, 3 * proj_out(cfg, p));
      add(kDev, Category::adapter, static_cast<size_t>(L) * norms);
    }
  } else {
    trained = specs;
    const bool zero2 = c.zero >= 2 && ranks.size > 1;  // and --zero 3
    if (c.step_in_backward || zero2) {
      std::vector<ParamSpec> kept;
      for (const ParamSpec& s : specs)
        if (s.name.rfind("model.layers.", 0) != 0 || s.name.rfind("model.layers.0.", 0) == 0) kept.push_back(s);
      add(kDev, Category::grads, set_bytes(kept, f));
      if (zero2) {  // and this rank's layer tensors' gradients, in one buffer
        int64_t n = 0;
        for (size_t i = 0; i < specs.size(); ++i)
          if (spec_owner[i] == ranks.rank && layer_of_name(specs[i].name) >= 0) n += numel(specs[i].shape);
        if (n > 0) add(kDev, Category::grads, nbytes(f, n));
      }
    } else {
      add(kDev, Category::grads, set_bytes(specs, f));
    }
  }

  // The optimizer.
  const int64_t rank = c.galore_rank > 0 ? c.galore_rank : std::max<int64_t>(E / 4, 1);
  std::vector<ParamSpec> stepped;  // the optimizer's tensors: all, or under --zero 1 this rank's share (as the trainer cuts it)
  if (c.zero >= 1 && ranks.size > 1) {
    std::vector<int64_t> sizes;
    for (const ParamSpec& s : trained) sizes.push_back(numel(s.shape));
    const std::vector<int> own = dist::owners(sizes, ranks.size);
    for (size_t i = 0; i < trained.size(); ++i)
      if (own[i] == ranks.rank) stepped.push_back(trained[i]);
  } else {
    stepped = trained;
  }
  const OptimBytes ob = optim_bytes(c.optim, stepped, rank);
  if (c.optim_state == "disk") {
    size_t file = 0, window = 0;
    disk_optim(c.optim, stepped, rank, &file, &window);
    add(kDisk, Category::optimizer, file);
    add(kDev, Category::optimizer, window);
  } else {
    add(c.optim_state == "device" ? kDev : kHost, Category::optimizer, ob.arena);
  }
  // Several ranks (data parallel): the buffer the gradients are summed through (Trainer::State::dp_stage).
  if (ranks.size > 1) {
    int64_t most = 0;
    for (const ParamSpec& s : trained) most = std::max(most, numel(s.shape));
    add(kHost, Category::workspace, a64(nbytes(f, 2 * std::min(most, dist::kSumBucket) + ranks.size)));
  }

  // Activations and the model's workspace. Context parallel: a rank holds its slice as one chunk.
  const int64_t cp = c.context_parallel;
  OOM_CHECK(cp == 1 || ranks.size % cp == 0, "[estimate] --context-parallel ", cp, " spreads each sequence over ", cp,
            " ranks: give --ranks ", cp, " (or a multiple of it: data parallel over groups of ", cp, ") too");
  const int64_t C = cp > 1 ? c.seq / cp : c.chunk > 0 ? std::min(c.chunk, c.seq) : 0;
  const int64_t T = C > 0 ? C : c.seq;
  const ModelBytes mb = model_bytes(ms, T, true, C > 0);
  add(kDev, Category::activations, mb.act_device);
  add(kHost, Category::activations, mb.act_host);
  add(kDisk, Category::activations, mb.act_disk);
  workspace_fixed += mb.workspace + zero3_wire;  // (the wire buffers: Device workspace held through the run)
  for (int64_t l = 0; l < L; ++l) {
    std::array<size_t, 3> per{};
    for (SavePolicy p : {SavePolicy::all, SavePolicy::selective, SavePolicy::none})
      per[static_cast<size_t>(p)] = p == SavePolicy::none ? 0
                                                          : act_set_bytes(ms, T, true, false, p,
                                                                          ms.store == DType::f32 ? f : ms.store, 1);
    est.layer_activations.push_back(per);
  }

  // Chunk-recurrent training's K/V store (model/paged_kv.cpp).
  int64_t key_blocks = 1, block_len = T;
  size_t transient = 0;
  size_t ring = 0;  // context parallel: the earlier slices' keys and their gradients beside attention's scratch
  if (cp > 1) {
    const KvDims kd{cfg.L, cfg.H, cfg.Hkv, cfg.D};
    const DType saved_kv = ms.store == DType::f32 ? f : ms.store;
    const RingOptions sp = ring_options(c);
    const int rr = static_cast<int>(ranks.rank % cp);
    ring = RingKv::device_bytes(kd, C, saved_kv, f, rr, sp);
    add(kHost, Category::workspace, RingKv::host_bytes(kd, C, rr, static_cast<int>(cp), saved_kv, f, sp));
  } else if (C > 0) {
    const int64_t P = c.page > 0 ? c.page : default_page(C);
    OOM_CHECK(c.page <= 0 || C % c.page == 0, "[estimate] --page ", c.page, " does not divide --chunk ", C,
              ": give a --page that divides it (or leave --page out)");
    OOM_CHECK(P > 0, "[estimate] --chunk ", C, " has no divisor from 8 to 64 for the K/V page: give --page P (a divisor "
              "of --chunk) or a --chunk that is a multiple of 64");
    const DType kvt = c.kv_dtype == "bf16" ? DType::bf16 : c.kv_dtype == "fp8" ? DType::f8_e4m3 : f;
    const size_t page = 2 * nbytes(kvt, cfg.Hkv * P * cfg.D), gpage = 2 * nbytes(f, cfg.Hkv * P * cfg.D);
    const int64_t ppc = C / P, max_chunks = (c.seq + C - 1) / C, hist = ((c.seq - 1) / C) * ppc;
    const KvOffload off = parse_kv_offload(c.kv_offload);
    const int home = off == KvOffload::none ? kDev : off == KvOffload::host ? kHost : kDisk;
    add(home, Category::kv, static_cast<size_t>(L * hist) * page);
    add(home, Category::kv_grad, static_cast<size_t>(L * hist) * gpage);
    if (off != KvOffload::none) {
      add(kDev, Category::kv, static_cast<size_t>(4 * ppc) * page);
      add(kDev, Category::kv_grad, static_cast<size_t>(4 * ppc) * gpage);
    }
    workspace_fixed += nbytes(f, 2 * C * cfg.H * cfg.D + cfg.H * C);
    if (c.sparse_pages > 0) {
      const int64_t S = c.page_summary == "mean" ? 1 : 2;
      add(kDev, Category::kv, nbytes(f, std::max<int64_t>(1, L * hist * S * cfg.Hkv * cfg.D)));
      const int64_t n = L * max_chunks * ppc;
      add(kHost, Category::kv, nbytes(DType::i32, n * (c.sparse_pages + c.sink_pages) + 1) + nbytes(DType::i32, n));
      workspace_fixed += nbytes(DType::i32, ppc * (c.sparse_pages + c.sink_pages + 1));
    }
    key_blocks = max_chunks * ppc;
    block_len = P;
  }

  // The kernels' scratch: the GEMM's packing (kept, grown to the largest product), and the largest call
  // held at once: attention, the LM head + cross-entropy, GaLore's SVD.
  const DType saved_k = ms.store == DType::f32 ? f : ms.store;
  for (bool backward : {false, true})
    transient = std::max(transient, ring + ops.attention_workspace(backward, T, cfg.H, cfg.Hkv, cfg.D, key_blocks,
                                                                   block_len, backward ? saved_k : f, ms.bf16));
  const bool head_widened = (tables_elsewhere && !adapters) || (tables_elsewhere && !head_trained);
  std::vector<std::array<int64_t, 3>> products = model_products(ms, T, !adapters);
  for (Ops::CeCall call : head_trained ? std::vector<Ops::CeCall>{Ops::CeCall::forward, Ops::CeCall::trained}
                                       : std::vector<Ops::CeCall>{Ops::CeCall::forward, Ops::CeCall::fused})
    transient = std::max(transient, ops.cross_entropy_workspace(call, T, E, V, ms.bf16, head_widened, &products));
  // The model's and the head's products take bf16 operands under bf16 compute; GaLore's are f32 always, and
  // run where the optimizer runs: on the host's backend, with its scratch in the Host arena, when the state
  // is in host memory (optim/host_placed.h).
  const bool optim_on_host = c.optim_state == "host";
  size_t optim_transient = 0;
  std::vector<std::array<int64_t, 3>> f32_products;
  for (const auto& [m, n] : c.optim.rfind("galore", 0) == 0 ? ob.projected : std::vector<std::array<int64_t, 2>>{}) {
    const int64_t r = rank;  // the SVD of each matrix, its projection and the step back (optim/galore.cpp)
    optim_transient = std::max(optim_transient, lapack::svd_workspace(m, n, sizeof(float)));
    f32_products.push_back({m >= n ? m : r, m >= n ? r : n, m >= n ? n : m});
    f32_products.push_back({m, n, r});
  }
  size_t pack_shared = 0, pack_own = 0;
  auto pack = [&](const std::vector<std::array<int64_t, 3>>& v, bool bf16, size_t& shared, size_t& own) {
    for (const auto& p : v) {
      const std::array<size_t, 2> b = ops.matmul_workspace(p[0], p[1], p[2], bf16);
      shared = std::max(shared, b[0]);
      own = std::max(own, b[1]);
    }
  };
  pack(products, ms.bf16, pack_shared, pack_own);
  if (optim_on_host) {
    size_t host_shared = 0, host_own = 0;
    pack(f32_products, false, host_shared, host_own);
    if (host_shared + host_own + optim_transient > 0)
      add(kHost, Category::workspace, host_shared + host_own + optim_transient);
  } else {
    pack(f32_products, false, pack_shared, pack_own);
    transient = std::max(transient, optim_transient);
  }
  const size_t run_workspace = workspace_fixed + pack_shared + pack_own + transient;
  add(kDev, Category::workspace, std::max(run_workspace, load_workspace));

  for (int t = 0; t < kTierCount; ++t) {
    size_t sum = 0;
    for (int ci = 0; ci < kCategoryCount; ++ci) sum += est.bytes[static_cast<size_t>(t)][static_cast<size_t>(ci)];
    est.tier_peak[static_cast<size_t>(t)] = sum;
  }
  // The Device's sum at its peak: the run's workspace, or the load's beside the weights alone.
  size_t dev = 0;
  for (int ci = 0; ci < kCategoryCount; ++ci) dev += est.bytes[kDev][static_cast<size_t>(ci)];
  const size_t ws = est.bytes[kDev][static_cast<size_t>(Category::workspace)];
  est.tier_peak[kDev] = std::max(dev - ws + run_workspace, weights + load_workspace);
  return est;
}

MemoryEstimate estimate_training(const TrainConfig& c) {
  const ModelSource src = open_model(c.model, static_cast<uint64_t>(c.seed));
  const std::unique_ptr<Ops> ops = make_ops(c.backend == "cuda" ? "cpu" : c.backend);
  return estimate_training(c, src, *ops);
}

namespace {

// FLOPs of one training step's matrix products per token (forward 2, backward 4 per weight) and of the
// blocks' forward alone (what recomputing costs), from the config: the time side of the changes below.
struct StepFlops {
  double step = 0, block_forward = 0;
};
StepFlops step_flops(const ModelConfig& cfg, int64_t T, bool adapters) {
  double block = 0;
  for (int p = 0; p < kProjCount; ++p)
    block += static_cast<double>(proj_out(cfg, static_cast<Proj>(p))) * static_cast<double>(proj_in(cfg, static_cast<Proj>(p)));
  const double attn = 2.0 * static_cast<double>(T) * static_cast<double>(cfg.H * cfg.D);  // causal: half of 4 T H D
  const double fwd = static_cast<double>(cfg.L) * (2.0 * block + attn) * static_cast<double>(T);
  const double head = 2.0 * static_cast<double>(cfg.V * cfg.E) * static_cast<double>(T);
  StepFlops f;
  f.block_forward = fwd;
  // Backward: twice the forward's products; a frozen base skips its weight gradients (half of that).
  f.step = (fwd + head) * (adapters ? 2.0 : 3.0);
  return f;
}

struct Change {
  std::string flags;  // as typed on the command line
  std::string cost;   // what it costs in time, in words
  double slowdown = 0;  // the cost as a fraction of a step (ordering)
  MemoryEstimate est;
};

}  // namespace

int run_estimate(const TrainConfig& c, bool as_json, int ranks) {
  const ModelSource src = open_model(c.model, static_cast<uint64_t>(c.seed));
  const std::unique_ptr<Ops> ops = make_ops("cpu");
  if (c.threads > 0) omp_set_num_threads(static_cast<int>(c.threads));  // the scratch of train's thread count
  // Several ranks: the rank holding the most (the budget is each rank's; ranks differ only in their share of a
  // sharded optimizer state).
  auto largest = [&](const TrainConfig& x, int* rank) {
    MemoryEstimate best = estimate_training(x, src, *ops, {ranks, 0});
    if (rank) *rank = 0;
    for (int r = 1; r < ranks && (x.zero >= 1 || x.context_parallel > 1); ++r) {
      MemoryEstimate e = estimate_training(x, src, *ops, {ranks, r});
      if (e.ram_peak() > best.ram_peak()) best = e, rank && (*rank = r);
    }
    return best;
  };
  int who = 0;
  const MemoryEstimate est = largest(c, &who);
  const size_t budget = c.budget.empty() ? 0 : parse_size(c.budget);
  const bool fits = budget == 0 || est.ram_peak() <= budget;
  const ModelConfig& cfg = src.cfg;
  const int64_t T = c.chunk > 0 ? std::min(c.chunk, c.seq) : c.seq;
  const StepFlops fl = step_flops(cfg, T, c.lora > 0);

  // The changes that cut memory, each alone and then accumulated in order of time cost, until one fits.
  std::vector<Change> changes;
  if (!fits) {
    struct Option {
      std::string flags;
      std::function<bool(TrainConfig&)> apply;  // false: does not apply to this run
      std::function<std::pair<double, std::string>()> cost;
    };
    auto free_of_time = [] { return std::make_pair(0.0, std::string("no extra compute")); };
    const double recompute = fl.block_forward / std::max(fl.step, 1.0);
    char words[160];
    std::vector<Option> options = {
        {"--zero 1", [&](TrainConfig& x) { return ranks > 1 && x.zero == 0 ? (x.zero = 1, true) : false; },
         [] { return std::make_pair(0.0, std::string("the optimizer state sharded over the ranks, the same bytes sent")); }},
        {"--zero 3",
         [&](TrainConfig& x) {
           if (ranks <= 1 || x.zero >= 3 || x.dora) return false;
           x.zero = 3;  // (a quantised base is refused: the option then does not apply)
           return true;
         },
         [&] {
           // SmolLM2 on 4 ranks of one machine: 0.85x the 1-rank step (docs/BENCHMARKS.md, ZeRO stage 3)
           return std::make_pair(0.15, std::string(c.lora > 0 ? "the frozen base's layer weights and the adapters' "
                                                               "optimizer state sharded; each layer's base weights "
                                                               "sent to every rank twice a step"
                                                             : "the layers' weights, gradients and optimizer state "
                                                               "sharded; each layer's weights sent to every rank twice "
                                                               "a step"));
         }},
        {"--zero-prefetch no",
         [&](TrainConfig& x) {
           if (ranks <= 1 || x.zero < 3 || x.zero_prefetch == "no") return false;
           x.zero_prefetch = "no";
           return true;
         },
         [] {
           // tiny over a 0.5 GB/s simulated link: 1.09x slower without it; level on one machine's shared memory
           return std::make_pair(0.05, std::string("one gathered layer instead of two; each layer's weights sent when "
                                                   "the pass reaches it (not while the layer before computes)"));
         }},
        {"--context-parallel " + std::to_string(ranks),
         [&](TrainConfig& x) {
           if (ranks <= 1 || x.context_parallel != 1 || x.seq % ranks || x.chunk > 0 ||
               x.act_offload != "none")
             return false;
           x.context_parallel = ranks;
           return true;
         },
         [] {
           return std::make_pair(0.05, std::string("each rank holds a slice of every sequence; keys and values sent "
                                                   "between the ranks at each layer"));
         }},
        {"--act-dtype bf16", [](TrainConfig& x) { return x.act_dtype == "fp32" ? (x.act_dtype = "bf16", true) : false; },
         [] { return std::make_pair(0.01, std::string("a rounding copy per saved tensor (within 0.1% of the fp32 loss)")); }},
        {"--optim adamw8bit", [](TrainConfig& x) { return x.optim == "adamw" ? (x.optim = "adamw8bit", true) : false; },
         free_of_time},
        {"--save-policy selective",
         [](TrainConfig& x) { return x.save_policy == "all" ? (x.save_policy = "selective", true) : false; },
         [&] {
           std::snprintf(words, sizeof words, "recomputes norms and SwiGLU (about %.0f%% of a step)", 100 * 0.05 * recompute);
           return std::make_pair(0.05 * recompute, std::string(words));
         }},
        {"--save-policy none",
         [](TrainConfig& x) { return x.save_policy != "none" ? (x.save_policy = "none", true) : false; },
         [&] {
           std::snprintf(words, sizeof words, "recomputes every block's forward (about +%.0f%% of a step's FLOPs)",
                         100 * recompute);
           return std::make_pair(recompute, std::string(words));
         }},
        {"--optim-state disk",
         [](TrainConfig& x) { return x.optim_state != "disk" ? (x.optim_state = "disk", true) : false; },
         [] { return std::make_pair(0.2, std::string("reads and writes the optimizer state once a step (disk bandwidth)")); }},
        {"--act-offload disk",
         [](TrainConfig& x) {
           return x.chunk == 0 && x.act_offload == "none" && x.save_policy != "none" ? (x.act_offload = "disk", true) : false;
         },
         [] { return std::make_pair(0.1, std::string("saved activations to disk and back, overlapped with compute")); }},
        {"--step-in-backward --clip-norm previous",
         [](TrainConfig& x) {
           if (x.lora > 0 || x.step_in_backward || x.chunk > 0 || x.batch * x.grad_accum != 1) return false;
           x.step_in_backward = true, x.clip_norm = "previous";
           return true;
         },
         free_of_time},
        {"--chunk 1024 --kv-offload host",
         [](TrainConfig& x) {
           if (x.chunk > 0 || x.seq <= 1024) return false;
           x.chunk = 1024, x.kv_offload = "host", x.act_offload = "none";
           return true;
         },
         [&] {
           std::snprintf(words, sizeof words, "chunk-recurrent: one more forward of every chunk (about +%.0f%%)", 100 * recompute);
           return std::make_pair(recompute + 0.05, std::string(words));
         }},
    };
    // Each option alone; then together, in order of cost, until the run fits (an option on the same flag as
    // an earlier one replaces it), and then without each one that the rest fit without.
    std::vector<size_t> together;
    auto build = [&](const std::vector<size_t>& picks, std::string* flags, double* cost) {
      TrainConfig x = c;
      *flags = "", *cost = 0;
      for (size_t i : picks) {
        if (!options[i].apply(x)) continue;
        *flags += (flags->empty() ? "" : " ") + options[i].flags;
        *cost += options[i].cost().first;
      }
      return x;
    };
    auto fits_with = [&](const std::vector<size_t>& picks, MemoryEstimate* e) {
      std::string f;
      double cost;
      try {
        *e = largest(build(picks, &f, &cost), nullptr);
        return e->ram_peak() <= budget;
      } catch (const Error&) {
        return false;
      }
    };
    bool found = false;
    for (size_t i = 0; i < options.size(); ++i) {
      TrainConfig one = c;
      if (!options[i].apply(one)) continue;
      const auto [cost, why] = options[i].cost();
      MemoryEstimate e;
      if (fits_with({i}, &e)) changes.push_back({options[i].flags, why, cost, e});
      if (found) continue;
      // the same flag as an earlier pick replaces it
      const std::string flag = options[i].flags.substr(0, options[i].flags.find(' '));
      std::erase_if(together, [&](size_t j) { return options[j].flags.rfind(flag + " ", 0) == 0; });
      together.push_back(i);
      found = fits_with(together, &e);
    }
    if (found && together.size() > 1) {
      MemoryEstimate e;
      for (size_t k = together.size(); k-- > 0;) {
        std::vector<size_t> less = together;
        less.erase(less.begin() + static_cast<std::ptrdiff_t>(k));
        if (fits_with(less, &e)) together = less;
      }
      if (together.size() > 1) {
        std::string flags;
        double cost = 0;
        build(together, &flags, &cost);
        fits_with(together, &e);
        changes.push_back({flags, "together", cost, e});
      }
    }
    std::stable_sort(changes.begin(), changes.end(), [](const Change& a, const Change& b) { return a.slowdown < b.slowdown; });
  }

  if (as_json) {
    json::Value o = json::Value::object();
    o.set("model", json::Value::string(c.model));
    o.set("estimate", est.json());
    o.set("budget", json::Value::integer(static_cast<int64_t>(budget)));
    {  // the model's shape: what a reader needs for the byte counts of sharding (ZeRO-3 sends the layers' tensors)
      json::Value shape = json::Value::object();
      int64_t total = 0, layers = 0, matrices = 0;
      for (const ParamSpec& p : param_specs(cfg)) {
        total += numel(p.shape);
        if (layer_of_name(p.name) >= 0) layers += numel(p.shape);
        if (layer_of_name(p.name) >= 0 && is_projection_weight(p.name)) matrices += numel(p.shape);
      }
      shape.set("layers", json::Value::integer(cfg.L));
      shape.set("width", json::Value::integer(cfg.E));
      shape.set("vocabulary", json::Value::integer(cfg.V));
      shape.set("parameters", json::Value::integer(total));
      shape.set("layer_parameters", json::Value::integer(layers));
      // of which the projection matrices' (bf16 on ZeRO-3's wire under bf16 compute; norms and biases in f32)
      shape.set("layer_matrix_parameters", json::Value::integer(matrices));
      o.set("shape", std::move(shape));
    }
    o.set("fits", json::Value::boolean(fits));
    if (ranks > 1) o.set("ranks", json::Value::integer(ranks)), o.set("rank", json::Value::integer(who));
    json::Value ch = json::Value::array();
    for (const Change& x : changes) {
      json::Value e = json::Value::object();
      e.set("flags", json::Value::string(x.flags));
      e.set("cost", json::Value::string(x.cost));
      e.set("ram_peak", json::Value::integer(static_cast<int64_t>(x.est.ram_peak())));
      ch.push_back(std::move(e));
    }
    o.set("changes", std::move(ch));
    std::printf("%s\n", json::dump(o).c_str());
    return fits ? 0 : 3;
  }
  std::printf("oomless estimate: %s, %lld layers, width %lld, %s parameters; --seq %lld%s\n", c.model.c_str(),
              static_cast<long long>(cfg.L), static_cast<long long>(cfg.E), format_count(cfg.param_count()).c_str(),
              static_cast<long long>(c.seq),
              c.chunk > 0 ? (" in chunks of " + std::to_string(std::min(c.chunk, c.seq))).c_str() : "");
  if (ranks > 1) {
    const std::string kind =
        c.context_parallel > 1
            ? "context parallel: slices of " + std::to_string(c.seq / c.context_parallel) + " tokens" +
                  (ranks > c.context_parallel ? ", data parallel over " + std::to_string(ranks / c.context_parallel) +
                                                    " groups"
                                              : std::string())
            : std::string("data parallel");
    const std::string zero = c.zero >= 1 ? ", --zero " + std::to_string(c.zero) : std::string();
    std::printf("one rank of %d (%s%s): rank %d, %s\n", ranks, kind.c_str(), zero.c_str(), who,
                c.zero >= 1 || c.context_parallel > 1 ? "the one holding the most" : "every rank holds the same");
  }
  std::fputs(est.table().c_str(), stdout);
  std::printf("static %s, dynamic %s; device + host peak %s", format_bytes(est.static_bytes()).c_str(),
              format_bytes(est.dynamic_bytes()).c_str(), format_bytes(est.ram_peak()).c_str());
  if (budget == 0) {
    std::printf(" (no --budget given)\n");
    return 0;
  }
  std::printf(fits ? ": fits --budget %s\n" : ": does NOT fit --budget %s\n", c.budget.c_str());
  if (fits) return 0;
  if (changes.empty()) {
    std::printf("none of the memory options makes it fit; a smaller --seq, --lora r or --qlora changes what trains\n");
    return 3;
  }
  std::printf("changes that make it fit (cheapest first):\n");
  for (const Change& x : changes)
    std::printf("  %-46s -> %s  (%s)\n", x.flags.c_str(), format_bytes(x.est.ram_peak()).c_str(), x.cost.c_str());
  return 3;
}

}  // namespace oomless
