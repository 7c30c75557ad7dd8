// The decode KV cache in bf16, fp8 (E4M3) and int8 against fp32 on a real model (generate --kv-dtype), and
// the one-row products with 8-bit activations (generate --decode-dot int8) against f32 ones, side by side in
// one process: the cache's bytes (fp8 and int8 with their per-row scales); the loss of a text decoded token by token through the cache (teacher forcing:
// every position's logits come from the cache of the positions before it) and at how many positions the
// most likely next token is the fp32 cache's; and for greedy continuations of prompts cut from the same
// text, where the first token differs. Also the decode step's time at the end of the text (its last positions
// decoded again, the variants taking turns; --tokens 1024 gives a cache of about 1K) against the bytes it must read (the weights as the
// ledger holds them plus the cache up to that position) over this machine's triad bandwidth (measured here).
//
//   build/release/bench_kv_cache --model ~/.cache/oomless/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
//       [--ids tests/golden/smollm2/eval.ids] [--tokens 512] [--prompts 8] [--new 64] [--dtypes bf16,fp8,int8]
//       [--dots f32,int8] [--compute fp32|bf16] [--embed-dtype auto|fp32|bf16|nf4] [--base-dtype fp32|bf16|nf4|nf4-dq]
// --compute bf16 runs the model in bf16 (generate --dtype bf16); --embed-dtype and --base-dtype store its embedding
// and head, and its projections, as generate's flags do.
// Every cache dtype runs with every product arithmetic of --dots; the first pair (fp32 cache, the first of
// --dots) is the one the others are compared with.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "triad.h"
#include "core/cpu_info.h"
#include "model/engine.h"
#include "io/gguf.h"
#include "model/generate.h"
#include "model/quant_base.h"

using namespace oomless;

namespace {

// The generate() cache and its bytes (keys, values and, for fp8 and int8, their row scales).
struct Cache {
  DecodeCache dc;
  size_t bytes = 0;
};

Cache make_cache(Arena& arena, const ModelConfig& cfg, int64_t cap, DType dt) {
  Cache c{make_decode_cache(arena, cfg, cap, dt)};
  for (const Buffer& b : c.dc.bufs) c.bytes += b.size();
  return c;
}

const char* cache_name(DType dt) {
  switch (dt) {
    case DType::f32: return "fp32";
    case DType::bf16: return "bf16";
    case DType::f8_e4m3: return "fp8";
    case DType::i8: return "int8";
    default: return "?";
  }
}

bool parse_dtypes(const std::string& list, std::vector<DType>& out) {
  size_t at = 0;
  while (at <= list.size()) {
    const size_t comma = std::min(list.find(',', at), list.size());
    const std::string w = list.substr(at, comma - at);
    if (w == "bf16") out.push_back(DType::bf16);
    else if (w == "fp8") out.push_back(DType::f8_e4m3);
    else if (w == "int8") out.push_back(DType::i8);
    else return false;
    at = comma + 1;
  }
  return !out.empty();
}

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

double log_softmax_at(const std::vector<float>& z, int32_t t) {
  const float m = *std::max_element(z.begin(), z.end());
  double s = 0;
  for (float x : z) s += std::exp(static_cast<double>(x - m));
  return static_cast<double>(z[static_cast<size_t>(t)] - m) - std::log(s);
}

}  // namespace

int main(int argc, char** argv) {
  const char* home = std::getenv("HOME");
  std::string model = std::string(home ? home : "") + "/.cache/oomless/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
  std::string ids_path = "tests/golden/smollm2/eval.ids";
  int64_t n_tokens = 512, prompts = 8, n_new = 64;
  std::string dtypes = "bf16,fp8,int8", dots = "f32,int8", compute = "fp32", embed_dtype = "auto", base_dtype = "fp32";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--model" && i + 1 < argc) model = argv[++i];
    else if (a == "--ids" && i + 1 < argc) ids_path = argv[++i];
    else if (a == "--tokens" && i + 1 < argc) n_tokens = std::atoll(argv[++i]);
    else if (a == "--prompts" && i + 1 < argc) prompts = std::atoll(argv[++i]);
    else if (a == "--new" && i + 1 < argc) n_new = std::atoll(argv[++i]);
    else if (a == "--dtypes" && i + 1 < argc) dtypes = argv[++i];
    else if (a == "--dots" && i + 1 < argc) dots = argv[++i];
    else if (a == "--compute" && i + 1 < argc) compute = argv[++i];
    else if (a == "--embed-dtype" && i + 1 < argc) embed_dtype = argv[++i];
    else if (a == "--base-dtype" && i + 1 < argc) base_dtype = argv[++i];
    else {
      std::fprintf(stderr,
                   "usage: bench_kv_cache [--model M] [--ids FILE] [--tokens N] [--prompts K] [--new N] "
                   "[--dtypes bf16,fp8,int8] [--dots f32,int8] [--compute fp32|bf16] [--embed-dtype D] [--base-dtype D]\n");
      return 2;
    }
  }
  if (compute != "fp32" && compute != "bf16") {
    std::fprintf(stderr, "bench_kv_cache: --compute takes fp32 or bf16 (got '%s')\n", compute.c_str());
    return 2;
  }
  std::vector<DType> kinds = {DType::f32};  // fp32 first: the others are measured against it
  if (!parse_dtypes(dtypes, kinds)) {
    std::fprintf(stderr, "bench_kv_cache: --dtypes takes a comma-separated list of bf16, fp8, int8 (got '%s')\n",
                 dtypes.c_str());
    return 2;
  }
  std::vector<bool> int8_dots;
  for (size_t at = 0; at <= dots.size();) {
    const size_t comma = std::min(dots.find(',', at), dots.size());
    const std::string w = dots.substr(at, comma - at);
    if (w != "f32" && w != "int8") {
      std::fprintf(stderr, "bench_kv_cache: --dots takes a comma-separated list of f32, int8 (got '%s')\n", dots.c_str());
      return 2;
    }
    int8_dots.push_back(w == "int8");
    at = comma + 1;
  }
  // (cache dtype, int8 products) pairs: every dtype with the first arithmetic, then with the others.
  std::vector<std::pair<DType, bool>> variants;
  for (bool d : int8_dots)
    for (DType t : kinds) variants.emplace_back(t, d);
  auto variant_name = [&](size_t k) {
    std::string n = cache_name(variants[k].first);
    if (int8_dots.size() > 1 || variants[k].second) n += variants[k].second ? " int8-dot" : " f32-dot";
    return n;
  };
  const size_t K = variants.size();
  std::vector<int32_t> text;
  {
    std::ifstream f(ids_path);
    for (int64_t x; f >> x && static_cast<int64_t>(text.size()) < n_tokens;) text.push_back(static_cast<int32_t>(x));
  }
  if (text.size() < 16) {
    std::fprintf(stderr, "bench_kv_cache: %s holds fewer than 16 ids\n", ids_path.c_str());
    return 2;
  }
  EngineOptions eo;
  eo.model = model;
  eo.keep_quantised = true;
  eo.dtype = parse_compute_dtype(compute);
  eo.embed_dtype = embed_dtype;
  eo.base_dtype = base_dtype;
  Engine e = build_engine(eo);
  const bool int8_possible = e.quant && e.quant->set_int8_activations(true) > 0;
  if (e.quant) e.quant->set_int8_activations(false);
  std::printf("int8 one-row products: %s (%s)\n", int8_possible ? "available" : "not available for this model",
              ggml_row_dot_q8_form());
  const ModelConfig& cfg = e.src.cfg;
  Model& m = *e.model;
  const CpuInfo cpu = detect_cpu();
  std::printf("cpu: %s; isa %s; %d threads\nmodel %s (compute %s, projections %s, embedding and head %s); %zu tokens "
              "of %s\n\n", cpu.model.c_str(), cpu.isa_summary().c_str(), get_threads(), model.c_str(), compute.c_str(),
              base_dtype.c_str(), embed_dtype.c_str(), text.size(), ids_path.c_str());
  m.reserve(std::max<int64_t>(static_cast<int64_t>(text.size()), 64), false);
  const int64_t T = static_cast<int64_t>(text.size());

  // Teacher-forced loss through the cache, one token at a time.
  std::vector<double> loss(K, 0.0), step_s(K, 0.0);
  std::vector<size_t> cache_bytes(K, 0);
  std::vector<int64_t> top_agree(K, 0);
  std::vector<float> logits(static_cast<size_t>(cfg.V));
  std::vector<int64_t> top(static_cast<size_t>(T), -1);
  std::vector<Cache> caches;
  for (size_t k = 0; k < K; ++k) {
    if (e.quant) e.quant->set_int8_activations(variants[k].second);
    Cache& c = caches.emplace_back(make_cache(e.mem->device, cfg, T, variants[k].first));
    cache_bytes[k] = c.bytes;
    for (int64_t t = 0; t + 1 < T; ++t) {
      m.decode_forward(Tensor(text.data() + t, DType::i32, {1}), t, c.dc.slots, Tensor::of(logits.data(), {cfg.V}));
      loss[k] -= log_softmax_at(logits, text[static_cast<size_t>(t + 1)]);
      const int64_t best = std::max_element(logits.begin(), logits.end()) - logits.begin();
      if (k == 0) top[static_cast<size_t>(t)] = best;
      else top_agree[k] += best == top[static_cast<size_t>(t)];
    }
    loss[k] /= static_cast<double>(T - 1);
  }
  // The step's time at the end of the text: the last four positions decoded again (the same tokens into the
  // same slots), the variants taking turns over eight rounds so that all see the same machine; medians of 32.
  const int64_t last = T - 5;
  {
    std::vector<std::vector<double>> times(K);
    for (int round = 0; round < 8; ++round)
      for (size_t k = 0; k < K; ++k) {
        if (e.quant) e.quant->set_int8_activations(variants[k].second);
        for (int64_t t = last; t < last + 4; ++t) {
          const double t0 = now();
          m.decode_forward(Tensor(text.data() + t, DType::i32, {1}), t, caches[k].dc.slots, Tensor::of(logits.data(), {cfg.V}));
          times[k].push_back(now() - t0);
        }
      }
    for (size_t k = 0; k < K; ++k) {
      std::sort(times[k].begin(), times[k].end());
      step_s[k] = times[k][times[k].size() / 2];
    }
  }
  size_t weight_bytes = 0;
  for (int i = 0; i < kTierCount; ++i) weight_bytes += e.mem->device.ledger().current(static_cast<Tier>(i), Category::weights);
  const double triad = bench::triad_bytes_per_s();
  std::printf("cache for %lld positions, teacher-forced loss through it, and the positions whose most likely next\n"
              "token is the fp32 cache's (of %lld):\n",
              static_cast<long long>(T), static_cast<long long>(T - 1));
  for (size_t k = 0; k < K; ++k) {
    std::printf("  %-13s %8.2f MiB (%.3fx)  loss %.6f (%+.4f%%)", variant_name(k).c_str(), cache_bytes[k] / 1048576.0,
                static_cast<double>(cache_bytes[k]) / static_cast<double>(cache_bytes[0]), loss[k],
                100.0 * (loss[k] - loss[0]) / loss[0]);
    if (k > 0)
      std::printf("  top-1 %lld (%.2f%%)", static_cast<long long>(top_agree[k]),
                  100.0 * static_cast<double>(top_agree[k]) / static_cast<double>(T - 1));
    std::printf("\n");
  }
  std::printf("\n");

  for (size_t k = 0; k < K; ++k) {
    const double kv_read = static_cast<double>(cache_bytes[k]) * static_cast<double>(last + 2) / static_cast<double>(T);
    const double ideal = (static_cast<double>(weight_bytes) + kv_read) / triad;
    std::printf("decode step at position ~%lld, %s: %.2f ms (median of 32, variants alternating); weights %.1f MiB + "
                "cache read %.1f MiB over triad %.1f GB/s = %.2f ms: %.2fx\n",
                static_cast<long long>(last + 2), variant_name(k).c_str(), 1e3 * step_s[k], weight_bytes / 1048576.0,
                kv_read / 1048576.0, triad / 1e9, 1e3 * ideal, step_s[k] / ideal);
  }
  std::printf("\n");

  // Greedy continuations of prompts cut from the text: where each cache's first differs from the fp32 cache's.
  std::vector<int64_t> same_runs(K, 0);
  std::printf("prompt  first disagreement with fp32 (of %lld new):", static_cast<long long>(n_new));
  for (size_t k = 1; k < K; ++k) std::printf(" | %s", variant_name(k).c_str());
  std::printf("\n");
  for (int64_t p = 0; p < prompts; ++p) {
    const int64_t start = (T / 2) * p / std::max<int64_t>(prompts, 1), len = 32;
    if (start + len > T) break;
    const std::vector<int32_t> prompt(text.begin() + start, text.begin() + start + len);
    GenerateOptions o;
    o.max_new = n_new;
    std::vector<std::vector<int32_t>> out(K);
    for (size_t k = 0; k < K; ++k) {
      if (e.quant) e.quant->set_int8_activations(variants[k].second);
      o.kv_dtype = variants[k].first;
      out[k] = generate(m, e.mem->device, prompt, o);
    }
    std::printf("%6lld ", static_cast<long long>(p));
    for (size_t k = 1; k < K; ++k) {
      int64_t first = -1;
      for (size_t i = 0; i < out[0].size() && i < out[k].size(); ++i)
        if (first < 0 && out[0][i] != out[k][i]) first = static_cast<int64_t>(i);
      if (first < 0 && out[0].size() != out[k].size()) first = static_cast<int64_t>(std::min(out[0].size(), out[k].size()));
      same_runs[k] += first < 0;
      std::printf(" %s", first < 0 ? "none" : std::to_string(first).c_str());
    }
    std::printf("\n");
  }
  for (size_t k = 1; k < K; ++k)
    std::printf("greedy continuations identical to the fp32 cache's, %s: %lld of %lld\n", variant_name(k).c_str(),
                static_cast<long long>(same_runs[k]), static_cast<long long>(prompts));
  return 0;
}
