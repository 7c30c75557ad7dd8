#include "model/generate.h"

#include <algorithm>
#include <cmath>
#include <random>

namespace oomless {

int32_t sample_next(const std::vector<float>& logits, double temperature, double top_p, uint64_t& rng_state) {
  if (temperature == 0.0)
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  const double mx = *std::max_element(logits.begin(), logits.end());
  std::vector<std::pair<double, int32_t>> pr;
  pr.reserve(logits.size());
  double z = 0;
  for (size_t v = 0; v < logits.size(); ++v) {
    const double p = std::exp((logits[v] - mx) / temperature);
    pr.push_back({p, static_cast<int32_t>(v)});
    z += p;
  }
  std::sort(pr.begin(), pr.end(), [](const auto& x, const auto& y) {
    return x.first > y.first || (x.first == y.first && x.second < y.second);
  });
  // The nucleus: the most likely tokens until their mass reaches top_p (at least one).
  double mass = 0;
  size_t keep = 0;
  while (keep < pr.size() && (keep == 0 || mass < top_p * z)) mass += pr[keep++].first;
  std::mt19937_64 rng(rng_state);
  rng_state = rng();
  const double r = static_cast<double>(rng_state >> 11) * 0x1.0p-53 * mass;
  double acc = 0;
  for (size_t k = 0; k < keep; ++k)
    if ((acc += pr[k].first) > r) return pr[k].second;
  return pr[keep - 1].second;
}

std::vector<int32_t> generate(Model& model, Arena& arena, const std::vector<int32_t>& prompt,
                              const GenerateOptions& opt, const std::function<void(int32_t)>& on_token) {
  const ModelConfig& cfg = model.config();
  OOM_CHECK(!prompt.empty(), "[generate] the prompt has no tokens");
  const int64_t P = static_cast<int64_t>(prompt.size()), cap = P + std::max<int64_t>(opt.max_new, 1);
  cfg.check_sequence(cap);
  // (Hkv, cap, D) keys and values per layer, in the compute dtype of the backend.
  const DType dt = model.params().dtype();
  std::vector<Buffer> bufs;
  std::vector<KvSlots> cache;
  const size_t bytes = static_cast<size_t>(dtype_bytes(dt, cfg.Hkv * cap * cfg.D));
  for (int64_t l = 0; l < cfg.L; ++l) {
    bufs.push_back(arena.alloc(bytes, Category::kv, "kv cache"));
    bufs.push_back(arena.alloc(bytes, Category::kv, "kv cache"));
    cache.push_back({bufs[bufs.size() - 2].view(dt, {cfg.Hkv, cap, cfg.D}), bufs.back().view(dt, {cfg.Hkv, cap, cfg.D}), 0});
  }
  model.reserve(P, false);
  std::vector<float> logits(static_cast<size_t>(cfg.V));
  std::vector<double> logits64(dt == DType::f64 ? static_cast<size_t>(cfg.V) : 0);
  auto step = [&](const int32_t* ids, int64_t n, int64_t t0) {
    if (dt == DType::f64) {
      model.decode_forward(Tensor(const_cast<int32_t*>(ids), DType::i32, {n}), t0, cache, Tensor::of(logits64.data(), {cfg.V}));
      for (size_t v = 0; v < logits.size(); ++v) logits[v] = static_cast<float>(logits64[v]);
    } else {
      model.decode_forward(Tensor(const_cast<int32_t*>(ids), DType::i32, {n}), t0, cache, Tensor::of(logits.data(), {cfg.V}));
    }
  };
  step(prompt.data(), P, 0);
  uint64_t rng = opt.seed;
  std::vector<int32_t> out;
  for (int64_t i = 0; i < opt.max_new; ++i) {
    const int32_t next = sample_next(logits, opt.temperature, opt.top_p, rng);
    out.push_back(next);
    if (on_token) on_token(next);
    if ((opt.stop_id && next == *opt.stop_id) || i + 1 == opt.max_new) break;
    step(&out.back(), 1, P + i);
  }
  return out;
}

}  // namespace oomless
