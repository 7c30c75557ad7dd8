#include "optim/optimizer.h"

#include "optim/adamw.h"
#include "optim/adamw8bit.h"
#include "optim/galore.h"

namespace oomless {

void parse_optimizer(std::string_view name) {
  OOM_CHECK(name == "adamw" || name == "adamw8bit" || name == "galore" || name == "galore8bit", "[train] --optim ",
            name, " is not an optimizer oomless has; use adamw (fp32 moments), adamw8bit (bitsandbytes' blockwise "
            "8-bit AdamW), galore or galore8bit (GaLore's low-rank projected Adam, fp32 or 8-bit moments)");
}

std::unique_ptr<Optimizer> make_optimizer(std::string_view name, const TrainableSet& params, Arena& arena,
                                          const AdamWSettings& settings, const GaLoreSettings& galore) {
  parse_optimizer(name);
  if (name == "galore" || name == "galore8bit") {
    GaLoreSettings g = galore;
    g.eight_bit = name == "galore8bit";
    return std::make_unique<GaLore>(params, arena, settings, g);
  }
  if (name == "adamw8bit") return std::make_unique<AdamW8bit>(params, arena, settings);
  return std::make_unique<AdamW>(params, arena, settings);
}

}  // namespace oomless
