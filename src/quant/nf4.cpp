// NF4 quantisation and dequantisation as bitsandbytes computes them (the rules are in nf4.h). Products
// that meet an addition are held in named floats so the compiler cannot fuse them into an FMA (which
// would round once where bitsandbytes rounds twice); the one FMA bitsandbytes does use is std::fmaf.
#include "quant/nf4.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/dynamic8.h"
#include "quant/torch_sum.h"

namespace oomless::nf4 {

const float kCode[16] = {
    -1.0f, -0.696192801f, -0.525073051f, -0.394917488f, -0.284441382f, -0.18477343f, -0.0910500363f, 0.0f,
    0.0795802996f, 0.160930201f, 0.246112302f, 0.337915242f, 0.440709829f, 0.562617004f, 0.722956836f, 1.0f,
};

namespace {

constexpr int64_t kMaxBlocksize = 4096;
constexpr float kMinAbsmax = 1e-38f;  // bitsandbytes clamps the scale's divisor (a float32 subnormal)

inline float load_f32(const float* p, int64_t i) {
  float v;
  std::memcpy(&v, p + i, sizeof v);
  return v;
}
inline void store_f32(float* p, int64_t i, float v) { std::memcpy(p + i, &v, sizeof v); }

// NF4 midpoints (kCode[k] + kCode[k+1]) / 2 in float32, as torch computes them.
struct Midpoints {
  float m[15];
  Midpoints() {
    for (int k = 0; k < 15; ++k) {
      const float s = kCode[k] + kCode[k + 1];
      m[k] = s / 2.0f;
    }
  }
};
const Midpoints& midpoints() {
  static const Midpoints mp;
  return mp;
}

// torch.bucketize(s, midpoints): the first k with midpoint_k >= s; a NaN s compares false everywhere
// and ends past the last midpoint, at 15.
inline uint8_t nf4_index(float s, const float* mid) {
  int lo = 0, hi = 15;
  while (lo < hi) {
    const int m = lo + (hi - lo) / 2;
    if (!(mid[m] >= s)) lo = m + 1;
    else hi = m;
  }
  return static_cast<uint8_t>(lo);
}

// torch.clamp(v, -1, 1): NaN stays NaN.
inline float clamp1(float v) { return v < -1.0f ? -1.0f : (v > 1.0f ? 1.0f : v); }

// torch.max over |w| of a block: NaN propagates.
float block_absmax(const float* w, int64_t len) {
  float a = 0.0f;
  for (int64_t i = 0; i < len; ++i) {
    const float v = std::fabs(w[i]);
    if (std::isnan(v)) return v;
    if (v > a) a = v;
  }
  return a;
}

// Elements are written in increasing order and blocks start at even elements, so an even element
// starts its byte and the odd one after it completes it.
inline void put_nibble(uint8_t* packed, int64_t i, uint8_t q) {
  if (i & 1) packed[i >> 1] = static_cast<uint8_t>(packed[i >> 1] | q);
  else packed[i >> 1] = static_cast<uint8_t>(q << 4);
}

// One block of `len` values starting at element `start` of the tensor. `full` selects bitsandbytes'
// full-block arithmetic (product with a reciprocal, scale stored unclamped) over the tail block's
// (division, scale stored clamped).
void quantize_block(const float* w, int64_t len, bool full, int64_t start, uint8_t* packed, float* absmax_out) {
  const float* mid = midpoints().m;
  const float a = block_absmax(w, len);
  const float divisor = std::max(a, kMinAbsmax);  // std::max(NaN, x) is NaN: a is its first argument
  if (full) {
    const float r = 1.0f / divisor;
    for (int64_t i = 0; i < len; ++i) put_nibble(packed, start + i, nf4_index(clamp1(w[i] * r), mid));
    *absmax_out = a;
  } else {
    for (int64_t i = 0; i < len; ++i) put_nibble(packed, start + i, nf4_index(clamp1(w[i] / divisor), mid));
    *absmax_out = divisor;
  }
}

void check_args(int64_t n, int64_t blocksize, const char* what) {
  OOM_CHECK(n >= 0, "[nf4] ", what, ": negative length ", n);
  OOM_CHECK(valid_blocksize(blocksize), "[nf4] ", what, ": blocksize ", blocksize,
            " is not one of bitsandbytes' 32, 64, 128, 256, 512, 1024, 2048, 4096");
}

template <class Widen>
void quantize_impl(int64_t n, int64_t blocksize, uint8_t* packed, float* absmax, Widen widen) {
  check_args(n, blocksize, "quantize");
  const int64_t nb = num_blocks(n, blocksize);
  // Blocks are independent and each fills whole bytes (blocks start at even elements): spread over the
  // OpenMP threads, the same bits for any number of them.
#pragma omp parallel for schedule(static) if (nb >= 64)
  for (int64_t b = 0; b < nb; ++b) {
    float buf[kMaxBlocksize];
    const int64_t start = b * blocksize, len = std::min(blocksize, n - start);
    widen(start, len, buf);
    float a;
    quantize_block(buf, len, len == blocksize, start, packed, &a);
    store_f32(absmax, b, a);
  }
  if (n & 1) put_nibble(packed, n, 7);  // bitsandbytes pads with a 0.0, which is code 7
}

}  // namespace

bool valid_blocksize(int64_t blocksize) {
  for (int64_t b = 32; b <= kMaxBlocksize; b *= 2)
    if (blocksize == b) return true;
  return false;
}

void quantize(const float* w, int64_t n, int64_t blocksize, uint8_t* packed, float* absmax) {
  quantize_impl(n, blocksize, packed, absmax,
                [w](int64_t start, int64_t len, float* buf) { std::memcpy(buf, w + start, sizeof(float) * len); });
}

void quantize(const uint16_t* w_bf16, int64_t n, int64_t blocksize, uint8_t* packed, float* absmax) {
  quantize_impl(n, blocksize, packed, absmax, [w_bf16](int64_t start, int64_t len, float* buf) {
    for (int64_t i = 0; i < len; ++i) buf[i] = bf16_to_f32(w_bf16[start + i]);
  });
}

void dequantize_range(const uint8_t* packed, const float* absmax, int64_t blocksize, int64_t start, int64_t count,
                      float* out) {
  OOM_CHECK(start >= 0 && count >= 0, "[nf4] dequantize_range: bad range start ", start, " count ", count);
  OOM_CHECK(valid_blocksize(blocksize), "[nf4] dequantize_range: blocksize ", blocksize, " is not valid");
  int64_t i = start;
  const int64_t end = start + count;
  while (i < end) {
    const int64_t b = i / blocksize;
    const int64_t block_end = std::min(end, (b + 1) * blocksize);
    const float scale = load_f32(absmax, b);
    for (; i < block_end; ++i) {
      const uint8_t byte = packed[i >> 1];
      const uint8_t q = (i & 1) ? (byte & 0x0Fu) : (byte >> 4);
      out[i - start] = kCode[q] * scale;
    }
  }
}

void dequantize(const uint8_t* packed, const float* absmax, int64_t n, int64_t blocksize, float* out) {
  dequantize_range(packed, absmax, blocksize, 0, n, out);
}

void quantize_dynamic8(const float* x, int64_t n, int64_t blocksize, uint8_t* codes, float* absmax) {
  OOM_CHECK(n >= 0 && blocksize > 0, "[nf4] quantize_dynamic8: bad length ", n, " or blocksize ", blocksize);
  const int64_t nb = num_blocks(n, blocksize);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t start = b * blocksize, end = std::min(n, start + blocksize);
    store_f32(absmax, b, dyn8::encode_block(dyn8::signed_map(), x + start, end - start, codes + start));
  }
}

float double_quantize(const float* absmax, int64_t n_blocks, int64_t nested_blocksize, uint8_t* codes,
                      float* nested_absmax, int torch_threads) {
  OOM_CHECK(n_blocks > 0, "[nf4] double_quantize: no scales");
  OOM_CHECK(valid_blocksize(nested_blocksize), "[nf4] double_quantize: nested blocksize ", nested_blocksize,
            " is not valid");
  // absmax - offset goes through the 8-bit kernel a nested block at a time, staged on the stack.
  float centred[kMaxBlocksize];
  const float offset = torch_mean_f32(absmax, n_blocks, torch_threads);
  for (int64_t s = 0; s < n_blocks; s += nested_blocksize) {
    const int64_t len = std::min(nested_blocksize, n_blocks - s);
    for (int64_t i = 0; i < len; ++i) centred[i] = load_f32(absmax, s + i) - offset;
    float a;
    quantize_dynamic8(centred, len, nested_blocksize, codes + s, &a);
    store_f32(nested_absmax, s / nested_blocksize, a);
  }
  return offset;
}

void dequantize_absmax(const uint8_t* codes, const float* nested_absmax, int64_t nested_blocksize, float offset,
                       int64_t start, int64_t count, float* absmax) {
  for (int64_t i = 0; i < count; ++i) {
    const int64_t k = start + i;
    const float p = kDynamicMap[codes[k]] * load_f32(nested_absmax, k / nested_blocksize);
    absmax[i] = p + offset;
  }
}

void check(const Matrix& m) {
  OOM_CHECK(m.rows > 0 && m.cols > 0, "[nf4] matrix shape (", m.rows, ", ", m.cols, ") must be positive");
  OOM_CHECK(m.rows <= (int64_t{1} << 40) / m.cols, "[nf4] matrix shape (", m.rows, ", ", m.cols, ") is too large");
  OOM_CHECK(valid_blocksize(m.blocksize), "[nf4] blocksize ", m.blocksize,
            " is not one of bitsandbytes' 32, 64, ..., 4096");
  OOM_CHECK(m.packed, "[nf4] matrix without packed codes");
  if (m.double_quant()) {
    OOM_CHECK(m.nested_absmax, "[nf4] double-quantised matrix without nested absmax");
    OOM_CHECK(valid_blocksize(m.nested_blocksize), "[nf4] nested blocksize ", m.nested_blocksize,
              " is not one of 32, 64, ..., 4096");
    OOM_CHECK(std::isfinite(m.offset), "[nf4] double-quant offset ", m.offset, " is not finite");
  } else {
    OOM_CHECK(m.absmax, "[nf4] matrix without absmax");
  }
}

void dequantize_rows(const Matrix& m, int64_t r0, int64_t n_rows, float* out) {
  OOM_CHECK(r0 >= 0 && n_rows >= 0 && r0 + n_rows <= m.rows, "[nf4] dequantize_rows: rows [", r0, ", ",
            r0 + n_rows, ") outside (", m.rows, ", ", m.cols, ")");
  const int64_t start = r0 * m.cols, count = n_rows * m.cols;
  if (!m.double_quant()) return dequantize_range(m.packed, m.absmax, m.blocksize, start, count, out);
  // Scales for up to 64 blocks at a time on the stack, then those blocks' elements.
  constexpr int64_t kChunk = 64;
  float scales[kChunk];
  int64_t i = start;
  const int64_t end = start + count;
  while (i < end) {
    const int64_t b0 = i / m.blocksize;
    const int64_t nb = std::min(kChunk, num_blocks(end, m.blocksize) - b0);
    dequantize_absmax(m.absmax_codes, m.nested_absmax, m.nested_blocksize, m.offset, b0, nb, scales);
    const int64_t stop = std::min(end, (b0 + nb) * m.blocksize);
    // dequantize_range reads scales[b - b0] for the blocks of [i, stop): shift the pointer by b0 blocks.
    dequantize_range(m.packed + (b0 * m.blocksize) / 2, scales, m.blocksize, i - b0 * m.blocksize, stop - i,
                     out + (i - start));
    i = stop;
  }
}

size_t storage_bytes(int64_t rows, int64_t cols, int64_t blocksize, bool double_quant, int64_t nested_blocksize) {
  const int64_t n = rows * cols, nb = num_blocks(n, blocksize);
  const int64_t floats = double_quant ? num_blocks(nb, nested_blocksize) : nb;
  const int64_t codes = double_quant ? nb : 0;
  return static_cast<size_t>(floats * 4 + codes + packed_bytes(n));
}

Matrix rebase(const Matrix& m, const void* from, const void* to) {
  auto move = [&](auto* p) {
    using P = decltype(p);
    return p ? reinterpret_cast<P>(static_cast<const uint8_t*>(to) +
                                   (reinterpret_cast<const uint8_t*>(p) - static_cast<const uint8_t*>(from)))
             : p;
  };
  Matrix r = m;
  r.packed = move(m.packed);
  r.absmax = move(m.absmax);
  r.absmax_codes = move(m.absmax_codes);
  r.nested_absmax = move(m.nested_absmax);
  return r;
}

Matrix copy_to(const Matrix& m, void* dst, size_t dst_bytes) {
  check(m);
  const int64_t nb = m.blocks();
  const int64_t floats = m.double_quant() ? num_blocks(nb, m.nested_blocksize) : nb;
  const int64_t codes = m.double_quant() ? nb : 0;
  const size_t need = storage_bytes(m);
  OOM_CHECK(dst_bytes >= need, "[nf4] copy_to: ", dst_bytes, " bytes given, ", need, " needed");
  OOM_CHECK(reinterpret_cast<uintptr_t>(dst) % alignof(float) == 0, "[nf4] copy_to: destination not 4-byte aligned");
  auto* base = static_cast<uint8_t*>(dst);
  Matrix r = m;
  auto* f = reinterpret_cast<float*>(base);
  std::memcpy(f, m.double_quant() ? m.nested_absmax : m.absmax, static_cast<size_t>(floats) * 4);
  uint8_t* c = base + floats * 4;
  if (m.double_quant()) {
    std::memcpy(c, m.absmax_codes, static_cast<size_t>(codes));
    r.nested_absmax = f, r.absmax_codes = c;
  } else {
    r.absmax = f;
  }
  uint8_t* p = c + codes;
  std::memcpy(p, m.packed, static_cast<size_t>(packed_bytes(m.numel())));
  r.packed = p;
  return r;
}

Matrix quantize_matrix(const float* w, int64_t rows, int64_t cols, int64_t blocksize, bool double_quant, void* dst,
                       size_t dst_bytes, int torch_threads) {
  Matrix m;
  m.rows = rows, m.cols = cols, m.blocksize = blocksize;
  OOM_CHECK(rows > 0 && cols > 0 && rows <= (int64_t{1} << 40) / cols, "[nf4] quantize_matrix: shape (", rows,
            ", ", cols, ") must be positive and below 2^40 elements");
  check_args(m.numel(), blocksize, "quantize_matrix");
  const size_t need = storage_bytes(rows, cols, blocksize, double_quant);
  OOM_CHECK(dst_bytes >= need, "[nf4] quantize_matrix: ", dst_bytes, " bytes given, ", need, " needed");
  OOM_CHECK(reinterpret_cast<uintptr_t>(dst) % alignof(float) == 0,
            "[nf4] quantize_matrix: destination not 4-byte aligned");
  const int64_t nb = m.blocks();
  auto* base = static_cast<uint8_t*>(dst);
  if (!double_quant) {
    auto* absmax = reinterpret_cast<float*>(base);
    auto* packed = base + nb * 4;
    quantize(w, m.numel(), blocksize, packed, absmax);
    m.absmax = absmax, m.packed = packed;
    return m;
  }
  // The plain scales are needed once, to compute their codes: a heap buffer for the call.
  const int64_t n_nested = num_blocks(nb, kNestedBlocksize);
  auto* nested = reinterpret_cast<float*>(base);
  uint8_t* codes = base + n_nested * 4;
  uint8_t* packed = codes + nb;
  std::vector<float> scales(static_cast<size_t>(nb));
  quantize(w, m.numel(), blocksize, packed, scales.data());
  m.offset = double_quantize(scales.data(), nb, kNestedBlocksize, codes, nested, torch_threads);
  m.absmax_codes = codes, m.nested_absmax = nested, m.nested_blocksize = kNestedBlocksize, m.packed = packed;
  return m;
}

}  // namespace oomless::nf4
