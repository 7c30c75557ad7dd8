// libFuzzer target: any bytes as a GGUF. Parsing, walking the metadata, dequantising every tensor of a
// supported type, and building config.json / HF tensors / tokenizer.json must either succeed or throw
// oomless::Error; anything else (a crash, a sanitizer report, another exception) is a bug.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/error.h"
#include "io/gguf.h"
#include "io/gguf_model.h"

using namespace oomless;

static size_t walk(const GgufValue& v) {
  size_t n = v.s.size() + v.ints.size() + v.floats.size();
  for (const auto& s : v.strings) n += s.size();
  for (const auto& a : v.arrays) n += walk(a);
  return n;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    GgufFile f = GgufFile::from_bytes(data, size, "fuzz.gguf");
    size_t total = 0;
    for (const auto& [k, v] : f.metadata()) total += k.size() + walk(v);
    std::vector<float> buf;
    for (const GgufTensor& t : f.tensors()) {
      // Bound the work per input; the parser already proved the bytes exist.
      if (!ggml_can_dequantize(t.type) || t.numel() > (int64_t{1} << 22)) continue;
      buf.resize(static_cast<size_t>(t.numel()));
      dequantize(t.type, t.data, t.numel(), buf.data());
    }
    try { gguf_config_json(f); } catch (const Error&) {}
    try { gguf_tokenizer_config(f); } catch (const Error&) {}
    try { gguf_tokenizer_json(f); } catch (const Error&) {}
    try {
      for (const GgufHfTensor& t : gguf_hf_tensors(f)) {
        if (!ggml_can_dequantize(t.src->type) || t.src->numel() > (int64_t{1} << 22)) continue;
        buf.resize(static_cast<size_t>(t.src->numel()));
        gguf_read_f32(t, buf.data());
      }
    } catch (const Error&) {}
    (void)total;
  } catch (const Error&) {
  }
  return 0;
}
