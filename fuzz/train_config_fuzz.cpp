// libFuzzer target for `oomless train --config FILE` (TrainConfig::apply_json, the same table that reads a
// run's saved configuration on --resume). The input is the JSON file. Rejection must be an oomless::Error;
// an accepted configuration must be written by to_json() as one that reads back to the same configuration,
// its --save-policy parses or is refused with an Error for models of several depths, and its memory estimate
// on preset:micro (train/estimate.h, closed form: nothing is allocated) is made or refused with an Error.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "core/error.h"
#include "model/model.h"
#include "io/json.h"
#include "backend/ops.h"
#include "model/load.h"
#include "train/estimate.h"
#include "train/trainer.h"

using namespace oomless;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  TrainConfig c;
  try {
    c.apply_json(json::parse(in, "fuzz train config"), "fuzz train config");
  } catch (const Error&) {
    return 0;
  }
  for (int64_t L : {-1, 0, 1, 4, 32}) {
    try {
      const std::vector<SavePolicy> p = parse_save_policies(c.save_policy, L);
      if (L >= 0 && static_cast<int64_t>(p.size()) != L) std::abort();
    } catch (const Error&) {
    }
  }
  {
    static const ModelSource micro = open_model("preset:micro");
    static const std::unique_ptr<Ops> ops = make_ops("cpu");
    TrainConfig e = c;
    e.model = "preset:micro";
    e.seq = std::min<int64_t>(e.seq, 1 << 14);  // a sequence the arithmetic can hold; the flags are what is fuzzed
    e.chunk = std::min<int64_t>(e.chunk, e.seq);
    e.sparse_pages = std::min<int64_t>(e.sparse_pages, 1 << 20), e.sink_pages = std::min<int64_t>(e.sink_pages, 1 << 20);
    try {
      if (estimate_training(e, micro, *ops).ram_peak() == 0) std::abort();
    } catch (const Error&) {
    }
  }
  const std::string text = json::dump(c.to_json());
  TrainConfig back;
  try {
    back.apply_json(json::parse(text, "fuzz to_json"), "fuzz to_json");
  } catch (const Error& e) {
    std::fprintf(stderr, "train_config_fuzz: to_json() wrote a configuration apply_json() refuses: %s\n%s\n", e.what(),
                 text.c_str());
    std::abort();
  }
  if (json::dump(back.to_json()) != text) {
    std::fprintf(stderr, "train_config_fuzz: a configuration changed on the way through to_json():\n%s\n%s\n",
                 text.c_str(), json::dump(back.to_json()).c_str());
    std::abort();
  }
  return 0;
}
