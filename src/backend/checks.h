// Argument validation shared by every backend, so each op checks the same things with the same
// "[op] ..." messages whatever the backend. Each returns the dimensions the kernel needs.
#pragma once
#include "backend/ops.h"

namespace oomless {

struct MatmulDims {
  int64_t M, N, K;
};
// a, b: `act` or bf16 (same dtype); c: act.
MatmulDims check_matmul(const Tensor& c, const Tensor& a, const Tensor& b, bool ta, bool tb, DType act);

struct RowsCols {
  int64_t rows, cols;
};
// Shapes and dtypes only: these checks read no tensor's memory (it may be a device's). The values of ids and
// targets are checked by each backend where it reads them: check_ids / check_targets below on host memory
// (the CPU backends' tensors themselves), with the same messages.
RowsCols check_embedding(const char* op, const Tensor& rows_out, const Tensor& ids, const Tensor& table, DType act,
                         bool table_may_be_bf16);
// Every id in [0, V): else "OP id X at position T is outside the vocabulary [0, V)".
void check_ids(const char* op, const int32_t* ids, int64_t T, int64_t V);
// Every target in [0, V) or ignore_index: else "OP target X of row T is outside the vocabulary ...".
void check_targets(const char* op, const int32_t* targets, int64_t T, int64_t V, int32_t ignore_index);
// For backends whose tensors are host memory (cpu, ref): check_embedding then check_ids over ids' values, and
// check_cross_entropy then check_targets over targets' values.
RowsCols check_embedding_host(const char* op, const Tensor& rows_out, const Tensor& ids, const Tensor& table, DType act,
                              bool table_may_be_bf16);
struct CeDims;
CeDims check_cross_entropy_host(const char* op, const Tensor& lse, const Tensor& h, const Tensor& w, const Tensor& targets,
                                int32_t ignore_index, DType act);
RowsCols check_rmsnorm(const char* op, const Tensor& out, const Tensor& rstd, const Tensor& in, const Tensor& weight,
                       DType act);
struct RopeDims {
  int64_t T, H, D;
};
RopeDims check_rope(const char* op, const Tensor& out, const Tensor& in, const Tensor& pos, DType act);
// Every tensor of `ts` has act dtype and the shape of the first.
void check_elementwise(const char* op, std::initializer_list<const Tensor*> ts, DType act);
// out and in of one shape in the act dtype, 0 <= p < 1.
void check_dropout(const char* op, const Tensor& out, const Tensor& in, double p, DType act);

// t is a block-quantised (rows, cols) view of its QuantMatrix (Tensor::quant) in the act dtype.
void check_quant_rows(const char* op, const char* name, const Tensor& t, DType act);
// DoRA's ops (ops.h): the (rows, cols) they work over.
RowsCols check_row_norms(const char* op, const Tensor& out, const Tensor& w, DType act);
RowsCols check_dora_scale(const char* op, const Tensor& g, const Tensor& n, const Tensor& m, const Tensor& wn,
                          const Tensor& b, const Tensor& p, const Tensor& q, DType act);
RowsCols check_dora_forward(const char* op, const Tensor& y, const Tensor& z, const Tensor& g, const Tensor& bias,
                            DType act);
RowsCols check_dora_backward(const char* op, const Tensor& dz, const Tensor& dm, const Tensor& dy, const Tensor& z,
                             const Tensor& g, const Tensor& n, DType act);
RowsCols check_scale_rows(const char* op, const Tensor& x, const Tensor& g, DType act);
// dst (N, K) f8_e4m3 or i8, scales (N) and src (N, K) act.
RowsCols check_cast_rows(const char* op, const Tensor& dst, const Tensor& scales, const Tensor& src, DType act);

struct AttentionDims {
  int64_t T, H, Hkv, D;
};
// q, o (T, H, D) and lse (H, T) act; q_pos (T) i32; kv blocks of one of kv_dtypes, lens within [0, P].
AttentionDims check_attention(const char* op, const Tensor& o, const Tensor& lse, const Tensor& q, const KvBlocks& kv,
                              const Tensor& q_pos, DType act, std::initializer_list<DType> kv_dtypes);
// The backward's extra arguments: dq, dout (T, H, D) act; dkv describes the same blocks as kv (geometry,
// positions, lengths) in act dtype.
void check_attention_backward(const char* op, const AttentionDims& d, const Tensor& dq, const Tensor& dout,
                              const KvBlocks& dkv, const KvBlocks& kv, DType act);

// o (T, H, D), lse (H, T), o2 (n, H, D), lse2 (H, n) with 0 <= row0 <= row0 + n <= T, all act dtype.
// Returns {T, H, 0, D}.
AttentionDims check_attention_merge(const char* op, const Tensor& o, const Tensor& lse, const Tensor& o2,
                                    const Tensor& lse2, int64_t row0, DType act);

struct CeDims {
  int64_t T, E, V;
};
// The targets' values: check_targets, by the backend.
CeDims check_cross_entropy(const char* op, const Tensor& lse, const Tensor& h, const Tensor& w, const Tensor& targets,
                           int32_t ignore_index, DType act);
// The same without lse: h (T, E), w (V, E) and targets (T) (target_logits).
CeDims check_head_rows(const char* op, const Tensor& h, const Tensor& w, const Tensor& targets, int32_t ignore_index,
                       DType act);

// The backward's outputs: dh (T, E) and dw (V, E), both act dtype.
void check_cross_entropy_backward(const char* op, const CeDims& d, const Tensor& dh, const Tensor& dw, DType act);

void check_adamw8bit(const Tensor& param, const Tensor& grad, const Tensor& m_codes, const Tensor& m_absmax,
                     const Tensor& v_codes, const Tensor& v_absmax, const AdamWConfig& cfg, DType act);
void check_svd_basis(const Tensor& out, const Tensor& g, bool right, DType act);
void check_adamw(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWConfig& cfg,
                 DType act);

}  // namespace oomless
