#include "model/generate.h"

#include <algorithm>
#include <cmath>
#include <random>

namespace oomless {

int32_t sample_next(std::vector<float> logits, const GenerateOptions& opt, const std::vector<int32_t>& seen,
                    uint64_t& rng_state) {
  if (opt.repetition_penalty != 1.0) {
    std::vector<uint8_t> hit(logits.size(), 0);
    for (int32_t t : seen)
      if (t >= 0 && static_cast<size_t>(t) < logits.size()) hit[static_cast<size_t>(t)] = 1;
    const float p = static_cast<float>(opt.repetition_penalty);
    for (size_t v = 0; v < logits.size(); ++v)
      if (hit[v]) logits[v] = logits[v] < 0 ? logits[v] * p : logits[v] / p;
  }
  if (opt.temperature == 0.0)
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  const double mx = *std::max_element(logits.begin(), logits.end());
  std::vector<std::pair<double, int32_t>> pr;
  pr.reserve(logits.size());
  for (size_t v = 0; v < logits.size(); ++v)
    pr.push_back({std::exp((logits[v] - mx) / opt.temperature), static_cast<int32_t>(v)});
  std::sort(pr.begin(), pr.end(), [](const auto& x, const auto& y) {
    return x.first > y.first || (x.first == y.first && x.second < y.second);
  });
  // Top-k first, then the nucleus: the most likely tokens until their mass reaches top_p of what is left
  // (at least one), as transformers applies its warpers.
  const size_t k = opt.top_k > 0 ? std::min(pr.size(), static_cast<size_t>(opt.top_k)) : pr.size();
  double z = 0;
  for (size_t i = 0; i < k; ++i) z += pr[i].first;
  double mass = 0;
  size_t keep = 0;
  while (keep < k && (keep == 0 || mass < opt.top_p * z)) mass += pr[keep++].first;
  std::mt19937_64 rng(rng_state);
  rng_state = rng();
  const double r = static_cast<double>(rng_state >> 11) * 0x1.0p-53 * mass;
  double acc = 0;
  for (size_t i = 0; i < keep; ++i)
    if ((acc += pr[i].first) > r) return pr[i].second;
  return pr[keep - 1].second;
}

DecodeCache make_decode_cache(Arena& arena, const ModelConfig& cfg, int64_t cap, DType dt) {
  DecodeCache c;
  const size_t bytes = static_cast<size_t>(dtype_bytes(dt, cfg.Hkv * cap * cfg.D));
  const size_t sbytes = static_cast<size_t>(dtype_bytes(DType::f32, cfg.Hkv * cap));
  for (int64_t l = 0; l < cfg.L; ++l) {
    KvSlots s;
    for (Tensor* t : {&s.k, &s.v}) {
      c.bufs.push_back(arena.alloc(bytes, Category::kv, "kv cache"));
      *t = c.bufs.back().view(dt, {cfg.Hkv, cap, cfg.D});
    }
    if (dt == DType::f8_e4m3 || dt == DType::i8) {
      for (Tensor* t : {&s.k_scale, &s.v_scale}) {
        c.bufs.push_back(arena.alloc(sbytes, Category::kv, "kv cache scales"));
        *t = c.bufs.back().view(DType::f32, {cfg.Hkv, cap});
      }
    }
    c.slots.push_back(s);
  }
  return c;
}

std::vector<int32_t> generate(Model& model, Arena& arena, const std::vector<int32_t>& prompt,
                              const GenerateOptions& opt, const std::function<void(int32_t)>& on_token) {
  const ModelConfig& cfg = model.config();
  OOM_CHECK(!prompt.empty(), "[generate] the prompt has no tokens");
  const int64_t P = static_cast<int64_t>(prompt.size()), cap = P + std::max<int64_t>(opt.max_new, 1);
  cfg.check_sequence(cap);
  // (Hkv, cap, D) keys and values per layer, in the compute dtype of the backend or --kv-dtype; fp8 and
  // int8 caches also keep a scale per kv head and position, (Hkv, cap) f32.
  const DType dt = model.params().dtype();
  const DType want = opt.kv_dtype;
  OOM_CHECK(want == DType::f32 || want == DType::bf16 || want == DType::f8_e4m3 || want == DType::i8, "[generate] --kv-dtype ",
            dtype_name(want), " is not a KV-cache storage oomless has; use fp32, bf16, fp8 or int8");
  OOM_CHECK(want == DType::f32 || dt == DType::f32, "[generate] a ", dtype_name(want),
            " KV cache needs the f32 (cpu) backend");
  const DType kvt = want == DType::f32 ? dt : want;
  DecodeCache dc = make_decode_cache(arena, cfg, cap, kvt);
  std::vector<KvSlots>& cache = dc.slots;
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
  std::vector<int32_t> seen = opt.repetition_penalty != 1.0 ? prompt : std::vector<int32_t>();
  for (int64_t i = 0; i < opt.max_new; ++i) {
    const int32_t next = sample_next(logits, opt, seen, rng);
    out.push_back(next);
    if (opt.repetition_penalty != 1.0) seen.push_back(next);
    if (on_token) on_token(next);
    if (opt.stops_at(next) || i + 1 == opt.max_new) break;
    step(&out.back(), 1, P + i);
  }
  return out;
}

}  // namespace oomless
