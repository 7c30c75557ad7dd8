// libFuzzer target for `oomless train --plan FILE` (apply_plan): the input is the plan file, applied to a
// preset:micro run at --seq 64 (with --budget 64MiB beside it for odd-sized inputs). Rejection must be an
// oomless::Error naming the file; an accepted plan must leave a configuration that validates, with a save policy
// for each of the model's layers.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "core/error.h"
#include "io/json.h"
#include "model/load.h"
#include "model/model.h"
#include "plan/planner.h"
#include "train/trainer.h"

using namespace oomless;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const ModelSource micro = open_model("preset:micro");
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  json::Value plan;
  try {
    plan = json::parse(in, "fuzz plan");
  } catch (const Error&) {
    return 0;
  }
  TrainConfig c;
  c.model = "preset:micro";
  c.seq = 64;
  if (size % 2) c.budget = "64MiB";  // the predicted peak held against a --budget given beside --plan
  try {
    apply_plan(c, plan, "fuzz.json", micro.cfg);
  } catch (const Error& e) {
    if (std::string(e.what()).find("fuzz.json") == std::string::npos) std::abort();
    return 0;
  }
  validate_config(c);  // an accepted plan is a valid run: this must not throw
  if (parse_save_policies(c.save_policy, micro.cfg.L).size() != static_cast<size_t>(micro.cfg.L)) std::abort();
  return 0;
}
