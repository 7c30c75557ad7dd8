// The bitsandbytes 4-bit quant state: arbitrary bytes as the quant_state JSON, then (after a NUL byte)
// control bytes that shape the tensors beside it: for each of weight, absmax, quant_map, nested_absmax
// and nested_quant_map whether it is present, its dtype, its size off by -3..+3, its shape's rank, and a
// flipped bit in a table. With no control bytes the tensors are exactly right, so a valid JSON seed
// reaches dequantisation. Rejection must be an oomless::Error; an accepted weight must dequantise every
// row without reading outside its tensors (ASan watches), and its invariants must hold.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "quant/bnb4.h"
#include "quant/nf4.h"

using namespace oomless;

namespace {

struct Control {
  const uint8_t* p;
  size_t n, i = 0;
  uint8_t next() { return i < n ? p[i++] : 0; }
};

// One tensor as the loader sees it, owning its bytes.
struct Owned {
  StTensor t;
  std::vector<uint8_t> bytes;
};

// Builds tensor `name` meant to be `dtype` with `want` elements, bent as control byte c says.
bool build(Owned& o, const char* name, const char* dtype, int64_t want, const float* table, Control& ctl,
           uint32_t& rng) {
  const uint8_t c = ctl.next();
  if (c & 1) return false;
  static const char* kSwap[] = {nullptr, nullptr, "I8", "F16"};
  const int variant = (c >> 1) & 3;
  const char* dt = variant == 0 ? dtype : variant == 1 ? (std::string_view(dtype) == "U8" ? "F32" : "U8")
                                                       : kSwap[variant];
  const int delta = ((c >> 3) & 7) == 0 ? 0 : ((c >> 3) & 7) - 4;
  const int64_t numel = std::max<int64_t>(0, want + delta);
  const size_t esize = std::string_view(dt) == "F32" ? 4 : std::string_view(dt) == "F16" ? 2 : 1;
  o.t.name = name;
  o.t.dtype_name = dt;
  o.t.shape = (c & 64) ? std::vector<int64_t>{numel, 1} : std::vector<int64_t>{numel};
  o.bytes.resize(static_cast<size_t>(numel) * esize);
  for (auto& b : o.bytes) {
    rng ^= rng << 13, rng ^= rng >> 17, rng ^= rng << 5;
    b = static_cast<uint8_t>(rng);
  }
  if (table && std::string_view(dt) == "F32") {
    std::memcpy(o.bytes.data(), table, std::min<size_t>(o.bytes.size(), static_cast<size_t>(want) * 4));
    if ((c & 128) && !o.bytes.empty()) {
      const size_t at = ctl.next() % o.bytes.size();
      o.bytes[at] ^= static_cast<uint8_t>(1u << (ctl.next() % 8));
    }
  } else if (std::string_view(dt) == "F32") {
    for (size_t k = 0; k + 4 <= o.bytes.size(); k += 4) {  // finite positive scales
      const float v = 0.001f + static_cast<float>(o.bytes[k]) / 64.0f;
      std::memcpy(o.bytes.data() + k, &v, 4);
    }
  }
  o.t.data = o.bytes.data();
  o.t.nbytes = o.bytes.size();
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto* nul = static_cast<const uint8_t*>(std::memchr(data, 0, size));
  const size_t json_len = nul ? static_cast<size_t>(nul - data) : size;
  Control ctl{data + json_len + (nul ? 1 : 0), nul ? size - json_len - 1 : 0};
  Bnb4QuantState qs;
  try {
    qs = parse_bnb4_quant_state(std::string_view(reinterpret_cast<const char*>(data), json_len), "fuzz");
  } catch (const Error&) {
    return 0;
  }
  // What the parser promises.
  if (qs.quant_type != "nf4" || !nf4::valid_blocksize(qs.blocksize) || qs.shape.empty()) __builtin_trap();
  if (qs.numel() < 1 || qs.numel() > (int64_t{1} << 40)) __builtin_trap();
  if (qs.nested != (qs.nested_blocksize != 0)) __builtin_trap();
  if (qs.nested && !nf4::valid_blocksize(qs.nested_blocksize)) __builtin_trap();
  if (qs.numel() > (int64_t{1} << 18)) return 0;  // keep buffers small

  const int64_t n = qs.numel(), blocks = nf4::num_blocks(n, qs.blocksize);
  const int64_t nested = qs.nested ? nf4::num_blocks(blocks, qs.nested_blocksize) : 1;
  uint32_t rng = 0x9E3779B9u ^ static_cast<uint32_t>(size);
  Owned w, a, q, na, nq;
  Bnb4Tensors t;
  if (build(w, "p.weight", "U8", nf4::packed_bytes(n), nullptr, ctl, rng)) t.weight = &w.t;
  if (build(a, "p.weight.absmax", qs.nested ? "U8" : "F32", blocks, nullptr, ctl, rng)) t.absmax = &a.t;
  if (build(q, "p.weight.quant_map", "F32", 16, nf4::kCode, ctl, rng)) t.quant_map = &q.t;
  const bool want_nested = qs.nested != ((ctl.next() & 1) != 0);  // a control bit can add or drop them
  if (want_nested && build(na, "p.weight.nested_absmax", "F32", nested, nullptr, ctl, rng)) t.nested_absmax = &na.t;
  if (want_nested && build(nq, "p.weight.nested_quant_map", "F32", 256, nf4::kDynamicMap, ctl, rng))
    t.nested_quant_map = &nq.t;
  nf4::Matrix m;
  try {
    m = bnb4_matrix(qs, t, "fuzz.safetensors", "p");
  } catch (const Error&) {
    return 0;
  }
  if (m.numel() != n || m.double_quant() != qs.nested || m.blocksize != qs.blocksize) __builtin_trap();
  std::vector<float> out(static_cast<size_t>(m.cols));
  for (int64_t r = 0; r < m.rows; ++r) nf4::dequantize_rows(m, r, 1, out.data());
  std::vector<float> all(static_cast<size_t>(n));
  nf4::dequantize_rows(m, 0, m.rows, all.data());
  return 0;
}
