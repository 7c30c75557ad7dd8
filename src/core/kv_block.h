// The K/V blocks attention reads (Ops::attention_forward / attention_backward): plain descriptions of memory,
// below backend/ and memory/ so that the page pool that hands them out and the kernels that read them share
// them without either including the other.
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace oomless {

// One block of keys and values: k and v each (Hkv, P, D) of KvBlocks::dtype; slots [0, len) hold the
// keys at absolute positions start .. start+len-1. A contiguous K/V is the one-block case (P = T).
struct KvBlock {
  void* k = nullptr;
  void* v = nullptr;
  int32_t start = 0;
  int32_t len = 0;
  // f8_e4m3 blocks: the value of code c is f8e4m3_to_f32(c) * k_scale (v_scale for V); unused otherwise.
  float k_scale = 1.0f, v_scale = 1.0f;
  // f8_e4m3 or i8 blocks with a scale per (kv head, position) row, (Hkv, P) f32 as Ops::cast_rows_scaled
  // writes them (the decode cache of generate --kv-dtype fp8|int8): when set, the value of code c in row
  // (g, j) is c's value times k_rows[g * P + j] (v_rows for V), and k_scale / v_scale are unused.
  const float* k_rows = nullptr;
  const float* v_rows = nullptr;
};
struct KvBlocks {
  const KvBlock* blocks = nullptr;
  int64_t n_blocks = 0;
  int64_t Hkv = 0, P = 0, D = 0;
  DType dtype = DType::f32;
  // bf16 compute: attention's products take bf16 operands (q, k, v, the probabilities, dout and the score
  // gradients rounded to bf16 where a product reads them; sums and softmax in fp32), as the model's other
  // products do. The cpu backend runs them on AMX tiles where the GEMM path is amx; ref ignores it.
  bool bf16_products = false;
};

}  // namespace oomless
