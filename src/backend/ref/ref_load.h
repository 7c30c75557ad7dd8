// Reading elements of the reference backend's operands, which are f64, bf16, or f64 read as bf16.
#pragma once
#include <cstdint>

#include "core/dtype.h"
#include "core/tensor.h"

namespace oomless::ref_detail {

// Element i of an f64 or bf16 tensor as double; an f64 tensor read as bf16 (Tensor::as_bf16) gives the
// value rounded to bf16 by convert(); a block-quantised matrix (Tensor::quant) its dequantised f32 value
// (bf16-rounded when read as bf16).
inline double load(const Tensor& t, int64_t i) {
  if (t.quant) {
    const int64_t cols = t.dims[t.ndim - 1];
    float v = 0;
    t.quant->dequant_row(*t.quant, t.qrow0 + i / cols, i % cols, 1, &v);
    return t.as_bf16 ? round_to_bf16(v) : v;
  }
  if (t.dtype == DType::bf16) return bf16_to_f32(static_cast<const uint16_t*>(t.data)[i]);
  const double x = static_cast<const double*>(t.data)[i];
  if (!t.as_bf16) return x;
  uint16_t h = 0;
  convert(&h, DType::bf16, &x, DType::f64, 1);
  return bf16_to_f32(h);
}

}  // namespace oomless::ref_detail
