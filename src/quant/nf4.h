// NF4 (4-bit NormalFloat) storage, bit-exact with bitsandbytes' CPU path (bitsandbytes 0.50.2 on torch
// 2.15; tests/golden/nf4, made by tools/golden/make_nf4.py).
//
// A tensor of n elements (row-major, flattened) is cut into blocks of `blocksize` consecutive elements
// (the last block may be shorter; blocks run across row ends). Each block keeps a float32 scale, its
// absmax, and each element the 4-bit index q of an NF4 code:
//   packed  (ceil(n/2)) bytes: element 2i in the HIGH nibble of byte i, 2i+1 in the low one; for odd n
//           the last low nibble is 7 (the code of 0.0), as bitsandbytes pads
//   absmax  (ceil(n/bs)) float32
//   w[i] ~= kCode[q[i]] * absmax[i / bs]       (one float32 product)
//
// Quantisation is bitsandbytes' quantize_4bit (the torch code its CPU backend runs), step by step:
//   a = max |w| over the block (NaN propagates, as torch.max does)
//   full blocks:         s = clamp(w * (1 / max(a, 1e-38f)), -1, 1), a stored as is
//   a last short block:  a' = max(a, 1e-38f), s = clamp(w / a', -1, 1), a' stored (so an all-zero tail
//                        block stores 1e-38f, an all-zero full block stores 0)
//   q = number of midpoints m_k = (kCode[k] + kCode[k+1]) / 2 (float32) with m_k < s: the nearest code,
//       a tie going to the lower code; NaN gives 15 (torch.bucketize's binary search).
// bitsandbytes widens bf16 input to float32 first, so the bf16 overload equals the float32 one on the
// widened values. bitsandbytes' bf16 dequantisation is the float32 result rounded to nearest even.
//
// Double quantisation (quantize_4bit(compress_statistics=True)) stores the B block scales as
//   offset = torch.mean(absmax) (float32, torch's CPU summation order: torch_sum.h)
//   codes (B) uint8 and nested_absmax (ceil(B/nested_bs)) float32: absmax - offset (float32 differences)
//       quantised by bitsandbytes' 8-bit blockwise CPU kernel with the signed dynamic map, nested
//       blocks of nested_bs = 256
//   absmax'[i] = kDynamicMap[codes[i]] * nested_absmax[i / nested_bs] + offset  (product rounded first)
// The 8-bit kernel (libbitsandbytes_cpu quantize_cpu_impl): b = max |x| over the nested block with NaN
// ignored (0 if none); b == 0 gives codes 0; else c = clamp(x * (1 / b), -1, 1) and
//   code = L[j], j = (int32) fmaf((1 + c) * 0.5f, 65535, 0.5f) (NaN: j = 0),
//   L[j] = number of dynamic-map midpoints (d_k + d_{k+1}) * 0.5f below (2j) / 65535.0f - 1,
// a 65536-entry grid over [-1, 1], so a code is the nearest one to the grid point, not to c itself.
// The fused multiply-add is the one bitsandbytes' compiled kernel executes (read in its binary); for
// this table an unfused one gives the same codes (searched near every table boundary), so nothing
// depends on the compiler there.
//
// Every routine here is single-threaded and reads float arrays with memcpy, so scales may sit unaligned
// in a file mapping. Nothing allocates but quantize_matrix with double quantisation (one float a block,
// for the call).
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/dynamic8.h"

namespace oomless::nf4 {

// The NF4 table (bitsandbytes get_4bit_type("nf4"), float32) and the signed 8-bit dynamic map
// (create_dynamic_map(), float32, sorted; entry 127 is 0, entry 255 is 1).
extern const float kCode[16];
inline const float* const kDynamicMap = dyn8::kSigned;

inline constexpr int64_t kNestedBlocksize = 256;  // what quantize_4bit uses for the absmax codes

// bitsandbytes' 4-bit blocksizes: 32, 64, ..., 4096.
bool valid_blocksize(int64_t blocksize);
inline int64_t num_blocks(int64_t n, int64_t blocksize) { return (n + blocksize - 1) / blocksize; }
inline int64_t packed_bytes(int64_t n) { return (n + 1) / 2; }

// w (n) -> packed (ceil(n/2)), absmax (ceil(n/blocksize)). blocksize must be valid; n >= 0.
void quantize(const float* w, int64_t n, int64_t blocksize, uint8_t* packed, float* absmax);
// The same for bf16 input (bits as uint16_t).
void quantize(const uint16_t* w_bf16, int64_t n, int64_t blocksize, uint8_t* packed, float* absmax);

// out (n) = kCode[q] * absmax[block].
void dequantize(const uint8_t* packed, const float* absmax, int64_t n, int64_t blocksize, float* out);
// Elements [start, start + count) of the same tensor into out (count); any start, odd ones included.
void dequantize_range(const uint8_t* packed, const float* absmax, int64_t blocksize, int64_t start, int64_t count,
                      float* out);

// Double quantisation of absmax (n_blocks): returns offset, writes codes (n_blocks) and nested_absmax
// (ceil(n_blocks / nested_blocksize)). `torch_threads` is the torch thread count whose summation order the
// offset follows (torch_sum.h; only matters from 32768 scales up).
float double_quantize(const float* absmax, int64_t n_blocks, int64_t nested_blocksize, uint8_t* codes,
                      float* nested_absmax, int torch_threads = 1);
// Scales [start, start + count) of a double-quantised absmax vector into absmax (count).
void dequantize_absmax(const uint8_t* codes, const float* nested_absmax, int64_t nested_blocksize, float offset,
                       int64_t start, int64_t count, float* absmax);

// bitsandbytes' 8-bit blockwise quantisation of x (n) with the dynamic map (the kernel above): codes (n),
// absmax (ceil(n / blocksize)).
void quantize_dynamic8(const float* x, int64_t n, int64_t blocksize, uint8_t* codes, float* absmax);

// One NF4 matrix (rows, cols) = (out_features, in_features) of a linear, row-major, in the layout above.
// A view: the arrays live elsewhere (a file mapping, or memory given to copy_to / quantize_matrix).
// Scales are either plain float32 (absmax) or double-quantised (absmax_codes + nested_absmax + offset).
struct Matrix {
  int64_t rows = 0, cols = 0;
  int64_t blocksize = 64;
  const uint8_t* packed = nullptr;        // (ceil(rows*cols / 2))
  const float* absmax = nullptr;          // (blocks) when not double-quantised; may be unaligned
  const uint8_t* absmax_codes = nullptr;  // (blocks) when double-quantised
  const float* nested_absmax = nullptr;   // (ceil(blocks / nested_blocksize)); may be unaligned
  int64_t nested_blocksize = 0;
  float offset = 0;

  int64_t numel() const { return rows * cols; }
  int64_t blocks() const { return num_blocks(numel(), blocksize); }
  bool double_quant() const { return absmax_codes != nullptr; }
};

// Throws oomless::Error "[nf4] ..." unless m is consistent (positive shape, valid blocksizes, the arrays
// its kind needs present, finite offset).
void check(const Matrix& m);
// out (n_rows, cols) = rows [r0, r0 + n_rows) dequantised to float32 (bitwise what bitsandbytes'
// dequantize_4bit gives for them in float32). 0 <= r0 <= r0 + n_rows <= rows.
void dequantize_rows(const Matrix& m, int64_t r0, int64_t n_rows, float* out);

// The same matrix read from a copy of its storage: each array that lies at `from` + k is taken at `to` + k
// (a matrix copied to another memory, e.g. staged on the host and uploaded to the device).
Matrix rebase(const Matrix& m, const void* from, const void* to);

// Bytes copy_to / quantize_matrix need (the float scales first, then codes, then packed nibbles).
size_t storage_bytes(int64_t rows, int64_t cols, int64_t blocksize, bool double_quant,
                     int64_t nested_blocksize = kNestedBlocksize);
inline size_t storage_bytes(const Matrix& m) {
  return storage_bytes(m.rows, m.cols, m.blocksize, m.double_quant(), m.nested_blocksize);
}
// Copies m's arrays into dst (at least storage_bytes(m), 4-byte aligned) and returns a view of dst.
Matrix copy_to(const Matrix& m, void* dst, size_t dst_bytes);
// Quantises w (rows, cols) as bitsandbytes' quantize_4bit into dst (storage_bytes(...)), with double
// quantisation (nested blocksize 256) when asked; returns the view.
Matrix quantize_matrix(const float* w, int64_t rows, int64_t cols, int64_t blocksize, bool double_quant,
                       void* dst, size_t dst_bytes, int torch_threads = 1);

}  // namespace oomless::nf4
