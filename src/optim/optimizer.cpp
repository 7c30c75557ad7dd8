#include "optim/optimizer.h"

#include "optim/adamw.h"
#include "optim/adamw8bit.h"

namespace oomless {

void parse_optimizer(std::string_view name) {
  OOM_CHECK(name == "adamw" || name == "adamw8bit", "[train] --optim ", name,
            " is not an optimizer oomless has; use adamw (fp32 moments) or adamw8bit (bitsandbytes' blockwise "
            "8-bit AdamW)");
}

std::unique_ptr<Optimizer> make_optimizer(std::string_view name, const TrainableSet& params, Arena& arena,
                                          const AdamWSettings& settings) {
  parse_optimizer(name);
  if (name == "adamw8bit") return std::make_unique<AdamW8bit>(params, arena, settings);
  return std::make_unique<AdamW>(params, arena, settings);
}

}  // namespace oomless
