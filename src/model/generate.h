// Text generation with a KV cache: prefill the prompt, then one token at a time. Temperature 0 is greedy
// (ties to the lowest id); otherwise softmax(logits / t) restricted to the nucleus of mass top_p, sampled
// with a seeded generator, so a seed reproduces a run.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "memory/arena.h"
#include "model/model.h"

namespace oomless {

struct GenerateOptions {
  int64_t max_new = 64;
  double temperature = 0.0;
  double top_p = 1.0;
  int64_t top_k = 0;               // > 0: sample among the k most likely tokens only
  // > 1: transformers' repetition penalty: the logit of every token already in the prompt or the output
  // is divided by it when positive, multiplied when negative (before greedy choice or sampling).
  double repetition_penalty = 1.0;
  uint64_t seed = 0;
  std::optional<int32_t> stop_id;  // stop after emitting it (end of sequence); none: run max_new
  std::vector<int32_t> stop_ids;   // more tokens that stop it (a chat's end of turn)
  // Storage of the KV cache: the model's compute dtype (f32), bf16 (half the bytes; keys and values rounded
  // as they are stored, attention reading the cache as it is), or f8_e4m3 / i8 (a quarter of the bytes plus
  // an f32 scale per kv head and position: each key and value row scaled by its own absolute max as it is
  // stored, Ops::cast_rows_scaled).
  DType kv_dtype = DType::f32;
  bool stops_at(int32_t id) const {
    return (stop_id && id == *stop_id) || std::find(stop_ids.begin(), stop_ids.end(), id) != stop_ids.end();
  }
};

// The KV cache (category kv) comes from `arena`. on_token is called after each new token.
// A decode cache for `cap` positions: per layer (Hkv, cap, D) keys and values in `dt` (f32, bf16, f8_e4m3 or
// i8), and for f8_e4m3 / i8 a scale per kv head and position, (Hkv, cap) f32; all in Category::kv.
struct DecodeCache {
  std::vector<Buffer> bufs;
  std::vector<KvSlots> slots;
};
DecodeCache make_decode_cache(Arena& arena, const ModelConfig& cfg, int64_t cap, DType dt);

std::vector<int32_t> generate(Model& model, Arena& arena, const std::vector<int32_t>& prompt,
                              const GenerateOptions& opt, const std::function<void(int32_t)>& on_token = {});

// The next token from logits (V) under the options (seen: the tokens the repetition penalty applies to);
// exposed for tests. Ties go to the lowest id.
int32_t sample_next(std::vector<float> logits, const GenerateOptions& opt, const std::vector<int32_t>& seen,
                    uint64_t& rng_state);

}  // namespace oomless
