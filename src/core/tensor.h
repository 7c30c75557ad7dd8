// Tensor: a non-owning, contiguous, row-major view of up to 4 dimensions.
// Owners are arena Buffers (memory/arena.h); a Tensor never frees. Shapes are documented at each use
// with the project-wide dimension names: T tokens, E width, F MLP width, H heads, Hkv kv heads,
// D head dim, V vocab, P page tokens, C chunk, L layers, B batch.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/dtype.h"
#include "core/error.h"
#include "core/tier.h"

namespace oomless {

struct Q8Act;  // core/q8_act.h

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<double>() { return DType::f64; }
template <> constexpr DType dtype_of<int32_t>() { return DType::i32; }
template <> constexpr DType dtype_of<int8_t>() { return DType::i8; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::u8; }

// A matrix (rows, cols) held in a block-quantised encoding (NF4, GGUF block types): a format name for
// messages, and a function that dequantises part of one row to f32. The owner keeps the blocks and
// scales (data, aux, param are its own); the GEMM calls dequant_row while it packs B panels, so no f32
// copy of the whole matrix exists.
struct QuantMatrix {
  const char* format = "";
  int64_t rows = 0, cols = 0;
  // out[0, n) = elements [col, col + n) of row r, as f32 (col + n <= cols).
  void (*dequant_row)(const QuantMatrix& q, int64_t r, int64_t col, int64_t n, float* out) = nullptr;
  // Optional, for one-row products (decoding): acc[8 i + l] += a[k] * element col + k of row rows[i], for the
  // k < n with k mod 8 = l in ascending k, each term one fused multiply-add: the bits of dequant_row followed
  // by the GEMM's eight-lane dot loop on a CPU with FMA, without the dequantised row. g <= 8. Returns false
  // where it cannot (a span that is not whole blocks); the GEMM then dequantises the rows.
  bool (*dot_rows)(const QuantMatrix& q, const int64_t* rows, int g, int64_t col, int64_t n, const float* a,
                   float* acc) = nullptr;
  // Optional, for one-row products with the activation row quantised to 8 bits (core/q8_act.h; a.blocks =
  // n / 32 blocks of elements [col, col + n)), set by the owner only where asked (QuantBase::
  // set_int8_activations: generate --decode-dot int8): out[i] = that product with row rows[i], i < g <= 8,
  // in integers (llama.cpp's arithmetic: not the bits of dequant_row's product). Returns false where it
  // cannot (a span that is not whole blocks; g = 0 only asks that), and the GEMM then takes the f32 path.
  bool (*dot_rows_q8)(const QuantMatrix& q, const int64_t* rows, int g, int64_t col, int64_t n, const Q8Act& a,
                      float* out) = nullptr;
  const void* data = nullptr;
  const void* aux = nullptr;
  int64_t param = 0;
};

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::f32;
  int ndim = 0;
  int64_t dims[4] = {0, 0, 0, 0};
  Tier tier = Tier::Host;
  // A float tensor read as bf16: every value is rounded to nearest even where an op reads it, with no
  // copy (bf16 compute over fp32 master weights). Only the ops that say so take such a tensor (the B
  // operand of matmul, the head of the fused cross-entropy); check_dtype refuses it everywhere else.
  bool as_bf16 = false;
  // Block-quantised storage (data unused): an f32 matrix (dims) whose rows are rows qrow0.. of *quant.
  // Only the B operand of matmul takes one (check_dtype refuses it everywhere else); as_bf16 then rounds
  // the dequantised values to bf16, as bf16 compute reads any weight.
  const QuantMatrix* quant = nullptr;
  int64_t qrow0 = 0;

  Tensor() = default;
  Tensor(void* d, DType t, std::initializer_list<int64_t> shape, Tier where = Tier::Host);
  // A view of base's memory (from its start, or `byte_offset` bytes in) in base's tier.
  Tensor(const Tensor& base, DType t, std::initializer_list<int64_t> shape)
      : Tensor(base.data, t, shape, base.tier) {}
  Tensor(const Tensor& base, int64_t byte_offset, DType t, std::initializer_list<int64_t> shape)
      : Tensor(static_cast<char*>(base.data) + byte_offset, t, shape, base.tier) {}
  template <class T>
  static Tensor of(T* d, std::initializer_list<int64_t> shape, Tier where = Tier::Host) {
    return Tensor(const_cast<std::remove_const_t<T>*>(d), dtype_of<std::remove_const_t<T>>(), shape, where);
  }

  int64_t numel() const;
  int64_t nbytes() const { return dtype_bytes(dtype, numel()); }
  // dim(-1) is the last dimension.
  int64_t dim(int i) const { return dims[i < 0 ? ndim + i : i]; }
  // Rows when viewed as a matrix (all leading dims folded) and the last dimension.
  int64_t rows() const { return ndim == 0 ? 1 : numel() / dims[ndim - 1]; }
  int64_t cols() const { return ndim == 0 ? 1 : dims[ndim - 1]; }
  // The same data under another shape with the same element count.
  Tensor reshape(std::initializer_list<int64_t> shape) const;
  // Typed pointer; throws when T does not match dtype (bf16/f16 are read as uint16_t).
  template <class T> T* as(const char* op) const {
    if constexpr (std::is_same_v<T, uint16_t>) {
      OOM_CHECK(dtype == DType::bf16 || dtype == DType::f16, op, " expected a 16-bit float tensor, got ", str());
    } else {
      OOM_CHECK(dtype == dtype_of<T>(), op, " expected ", dtype_name(dtype_of<T>()), ", got ", str());
    }
    return static_cast<T*>(data);
  }
  std::string str() const;  // e.g. "f32[7, 33]", "f32 as bf16[7, 33]"
  // This view with as_bf16 set.
  Tensor read_as_bf16() const {
    Tensor t = *this;
    t.as_bf16 = true;
    return t;
  }
  bool same_shape(const Tensor& o) const;
};

// Argument checks shared by every backend. Each throws oomless::Error "[op] ...".
void check_shape(const char* op, const char* name, const Tensor& t, std::initializer_list<int64_t> shape);
void check_dtype(const char* op, const char* name, const Tensor& t, std::initializer_list<DType> allowed);
void check_same_shape(const char* op, const char* a_name, const Tensor& a, const char* b_name, const Tensor& b);

// A tensor with its name, as checkpoints and adapter files list them (owners give these lists).
struct NamedTensor {
  std::string name;
  Tensor t;
};

}  // namespace oomless
