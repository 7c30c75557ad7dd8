// Linear: one projection of the model as a value, y = x W^T + b with an optional LoRA adapter and DoRA
// magnitude (model/lora.h), and the gradients the run keeps for it. Every projection of a block and the
// LM head is one; the model assembles it from the base weights (any storage the GEMM reads: f32, f32
// read as bf16, or a block-quantised matrix through Tensor::quant), the adapter set and the gradient
// sets, so block code speaks of "the k projection" rather than of tensors picked from four tables.
//
// rows(r0, n) narrows it to rows [r0, r0 + n) of the output (one kv head of k_proj / v_proj): W, b, B, and
// DoRA's per-row n and g, with their gradients; the adapter's A (and its input side) stays whole.
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace oomless {

struct Linear {
  Tensor w, b;    // (N, K) as the GEMM reads it; (N) or empty
  Tensor gw, gb;  // their gradients; empty when frozen (no dW GEMM runs)
  // LoRA: A (r, K), B (N, r) as the GEMMs read them, their gradients; empty when not adapted.
  Tensor a, bm, ga, gbm;
  double scale = 0;  // s = alpha / r (rsLoRA: alpha / sqrt(r))
  // DoRA: the step's g = m / n and n (N), the magnitude's gradient; empty without DoRA.
  Tensor g, n, gm;
  uint64_t dropout_seed = 0;  // this projection's LoRA dropout stream

  bool lora() const { return a.data != nullptr; }
  bool dora() const { return g.data != nullptr; }
  int64_t out() const { return w.dims[0]; }
  int64_t in() const { return w.dims[1]; }
  Linear rows(int64_t r0, int64_t count) const;
};

// Rows [r0, r0 + n) of a row-major matrix (R, cols), as an (n, cols) view keeping as_bf16 and a quantised
// matrix's row offset; empty for an empty tensor (a frozen weight's gradient).
Tensor rows_of(const Tensor& t, int64_t r0, int64_t n);
// Elements [e0, e0 + n) of a vector, or empty.
Tensor span_of(const Tensor& t, int64_t e0, int64_t n);

}  // namespace oomless
