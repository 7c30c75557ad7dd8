// libFuzzer target for a model's config.json (ModelConfig::from_json) and the --rope-scaling argument
// (apply_rope_scaling). The input is config.json, optionally followed by a NUL byte and a rope-scaling
// spec ("yarn:4", "none", a rope_scaling JSON object, ...). Rejection must be an oomless::Error. An
// accepted config must be written by to_json() as a config that reads back to the same config, and its
// parameter count and list must be computable (no overflow: UBSan reports it).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "core/error.h"
#include "io/json.h"
#include "model/config.h"

using namespace oomless;

namespace {

// The config as to_json() writes it must read back to itself.
void round_trip(const ModelConfig& c) {
  const std::string text = json::dump(c.to_json());
  ModelConfig back;
  try {
    back = ModelConfig::from_json(json::parse(text, "fuzz to_json"), "fuzz to_json");
  } catch (const Error& e) {
    std::fprintf(stderr, "model_config_fuzz: to_json() wrote a config that from_json() refuses: %s\n%s\n", e.what(),
                 text.c_str());
    std::abort();
  }
  if (json::dump(back.to_json()) != text) {
    std::fprintf(stderr, "model_config_fuzz: a config changed on the way through to_json():\n%s\n%s\n", text.c_str(),
                 json::dump(back.to_json()).c_str());
    std::abort();
  }
  (void)c.param_count();
  if (c.L <= 1024) (void)param_specs(c);  // one entry per tensor: bounded so that one input stays fast
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const size_t nl = in.find('\0');
  ModelConfig c;
  try {
    c = ModelConfig::from_json(json::parse(in.substr(0, nl), "fuzz config.json"), "fuzz config.json");
  } catch (const Error&) {
    return 0;
  }
  round_trip(c);
  if (nl == std::string_view::npos) return 0;
  try {
    apply_rope_scaling(c, in.substr(nl + 1), "fuzz --rope-scaling");
  } catch (const Error&) {
    return 0;
  }
  round_trip(c);
  return 0;
}
