// Text generation with a KV cache: prefill the prompt, then one token at a time. Temperature 0 is greedy
// (ties to the lowest id); otherwise softmax(logits / t) restricted to the nucleus of mass top_p, sampled
// with a seeded generator, so a seed reproduces a run.
#pragma once
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
  uint64_t seed = 0;
  std::optional<int32_t> stop_id;  // stop after emitting it (end of sequence); none: run max_new
};

// The KV cache (category kv) comes from `arena`. on_token is called after each new token.
std::vector<int32_t> generate(Model& model, Arena& arena, const std::vector<int32_t>& prompt,
                              const GenerateOptions& opt, const std::function<void(int32_t)>& on_token = {});

// The next token from logits (V) under the options; exposed for tests.
int32_t sample_next(const std::vector<float>& logits, double temperature, double top_p, uint64_t& rng_state);

}  // namespace oomless
