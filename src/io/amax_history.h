// Delayed fp8 scaling's amax history (the paged K/V store's and the activation store's) in checkpoints.
#pragma once
#include <string>
#include <vector>

#include "io/json.h"

namespace oomless {

// A delayed-scaling amax history (per tensor, its last kAmaxHistory values) as JSON, exactly, and back into
// h (sized already): a list of another length is refused as another run's (naming `per`, e.g. "2 per
// layer"), an entry that is not a list of at most kAmaxHistory finite numbers >= 0 as damaged; `who` is the
// messages' prefix ("[kv]").
json::Value amax_history_json(const std::vector<std::vector<float>>& h);
void restore_amax_history(std::vector<std::vector<float>>& h, const json::Value& state, const char* who,
                          const std::string& per);

}  // namespace oomless
