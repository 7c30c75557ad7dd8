// Parses arbitrary bytes as JSON. Rejection must be an oomless::Error; an accepted document must
// survive dump() and parse() unchanged, in both the compact and the pretty form.
#include <cstdint>
#include <string>
#include <string_view>

#include "core/error.h"
#include "io/json.h"

using namespace oomless;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  json::Value v;
  try {
    v = json::parse(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
  } catch (const Error&) {
    return 0;
  }
  // A parsed document is always writable and reads back equal; anything else is a bug (an escaping
  // exception or a trap both report as a crash).
  for (int indent : {-1, 2}) {
    const std::string text = json::dump(v, indent);
    const json::Value back = json::parse(text, "fuzz dump");
    if (!(back == v)) __builtin_trap();
    if (json::dump(back, indent) != text) __builtin_trap();
  }
  return 0;
}
