// Arbitrary bytes as an adapter_config.json, then resolved against three small models (GQA untied, tied
// Qwen2-style biases, Qwen3 q/k norms with three layers). Rejection must be an oomless::Error. An accepted
// config must write text that parses back to the same text; a resolved layout must name only modules of
// the model with 0 < r <= min(in, out), and its tensor keys must map back to themselves.
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "core/error.h"
#include "io/json.h"
#include "io/peft.h"
#include "model/config.h"

using namespace oomless;

namespace {

ModelConfig model(Arch arch, int64_t L, bool tied) {
  ModelConfig c;
  c.arch = arch;
  c.L = L, c.E = 32, c.F = 56, c.H = 4, c.Hkv = 2, c.D = arch == Arch::qwen3 ? 12 : 8, c.V = 128;
  c.tied = tied;
  c.qkv_bias = arch == Arch::qwen2;
  c.qk_norm = arch == Arch::qwen3;
  return c;
}

void check_layout(const AdapterLayout& lay, const ModelConfig& c) {
  for (const LoraTarget& t : lay.targets) {
    if (t.layer < 0 || t.layer >= c.L) __builtin_trap();
    if (t.r <= 0 || t.r > t.in_features || t.r > t.out_features) __builtin_trap();
    if (!std::isfinite(t.scale) && std::isfinite(t.alpha)) __builtin_trap();
  }
  for (const auto& [key, shape] : lay.tensors())
    if (adapter_key(parse_adapter_key(key)) != key) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  // The raw bytes as a tensor key too: parsing either succeeds and round-trips or is an Error.
  try {
    const AdapterKey k = parse_adapter_key(text, "fuzz");
    if (adapter_key(k) != text) __builtin_trap();
  } catch (const Error&) {
  }

  AdapterConfig a;
  try {
    a = AdapterConfig::from_json(json::parse(text, "fuzz"), "fuzz");
  } catch (const Error&) {
    return 0;
  }
  const std::string written = a.to_text();
  const AdapterConfig back = AdapterConfig::from_json(json::parse(written, "fuzz written"), "fuzz written");
  if (back.to_text() != written) __builtin_trap();

  static const ModelConfig models[] = {model(Arch::llama, 2, false), model(Arch::qwen2, 2, true),
                                       model(Arch::qwen3, 3, false)};
  for (const ModelConfig& c : models) {
    // PEFT's expansion of all-linear (what it saves) must adapt the same modules, or fail the same way.
    std::optional<AdapterLayout> direct, expanded;
    try {
      direct = resolve_adapter(a, c, "fuzz");
    } catch (const Error&) {
    }
    try {
      expanded = resolve_adapter(a.with_all_linear_expanded(c), c, "fuzz expanded");
    } catch (const Error&) {
    }
    if (direct.has_value() != expanded.has_value()) __builtin_trap();
    if (!direct) continue;
    check_layout(*direct, c);
    if (direct->tensors() != expanded->tensors()) __builtin_trap();
  }
  return 0;
}
